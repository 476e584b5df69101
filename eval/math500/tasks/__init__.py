"""lm-eval task files for MATH-500 (``hl_math500.yaml`` + its ``utils.py``); point lm-eval's
``--include_path`` / ``TaskManager(include_path=...)`` at this directory."""
