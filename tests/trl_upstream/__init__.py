"""TRL's own DPO, KTO and GRPO trainer tests, run unmodified against TRL's trainers and against ours."""
