"""Everything ``launchers/run.py`` checks before GPU time, with no weights and no GPU.

* ``validate.py``: ``--validate`` (after the recipe's cross-field checks, ``config.validation``: layout, model config,
  tokenizer, data rows), from a ``config.Validation``;
* ``plan.py``: ``--plan`` (the world layout and a per-GPU memory estimate) from a ``config.RunShape``, with
  ``plan_terms.py`` (activation and logit bytes per token) and ``plan_lora.py`` (the adapter's parameters from PEFT's
  own matching).
"""
