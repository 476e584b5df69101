"""``python -m hl_core.integrations.trl dpo|kto|grpo --config FILE.yaml [--flag value ...]`` (``cli``)."""

from .cli import entry

entry()
