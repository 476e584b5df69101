"""Everything ``launchers/run.py`` checks before GPU time, with no weights and no GPU.

* ``validate.py``: ``--validate`` (the recipe's cross-field checks, layout, model config, tokenizer, data rows);
* ``plan.py``: ``--plan`` (the world layout and a per-GPU memory estimate), with ``plan_terms.py`` (activation
  and logit bytes per token) and ``plan_lora.py`` (the adapter's parameters from PEFT's own matching).
"""
