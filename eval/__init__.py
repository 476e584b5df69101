"""Evaluation tools for the humanline recipes (package ``eval``; run ``python -m eval --help``).

* `eval.math500`: MATH-500 pass@1 through lm-eval, scored with math-verify.
* `eval.alpaca`: AlpacaEval generation + judging with the ``alpaca_eval`` package (API, reward-model or
  callable judges); win rate and, when available, length-controlled win rate.
* `eval.data_quality`: the paper's data-quality proxy (mean token log-prob under the reference).
* `eval.report`: PNG plots + HTML from runs' ``metrics.jsonl``.
* `eval.run_from_recipe`: the post-training hook driven by a recipe's ``eval:`` block.

Nothing is imported here, so ``import eval.report`` does not pull in lm-eval or alpaca_eval.
"""
