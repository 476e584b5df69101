"""``python -m eval.math500 MODEL_DIR [--data FILE] [python -m eval flags]``: MATH500 only.

Same as ``python -m eval MODEL_DIR --math500 [FILE] ...`` (see ``python -m eval --help`` for the flags:
--samples, --temperature, --top-p, --max-new-tokens, --prompt, --backend, --batch-size, --limit, --output,
--offline).
"""

import sys

from eval.__main__ import single_block_main

if __name__ == "__main__":
    from hl_core.errors import exit_on_user_error

    exit_on_user_error(single_block_main, "--math500", sys.argv[1:])
