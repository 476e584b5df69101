"""Humanline on other libraries' trainers: ``hl_core.integrations.trl`` (TRL's DPO, KTO and GRPO trainers)."""
