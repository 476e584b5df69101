"""hl_core: the minimal core of the humanline recipe pack.

DPO, KTO and GRPO with humanline reference syncing, asymmetric log-ratio clipping
and humanline sampling, on DeepSpeed and Megatron-core.
"""

__version__ = "0.1.0"
