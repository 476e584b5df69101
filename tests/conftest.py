import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import os
import socket

import pytest


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if anything opens an internet socket (the Hugging Face hub included)."""
    attempts = []
    real = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"network access blocked in tests: {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield
    assert not attempts, f"network access attempted: {attempts}"


@pytest.fixture(scope="session")
def repro_cache(tmp_path_factory):
    """One cache of the reproduction studies' quick warm-ups, shared by their tests (built once per session)."""
    return tmp_path_factory.mktemp("repro-cache")


@pytest.fixture(scope="session")
def repro_pool(tmp_path_factory):
    """The study workers (``eval.repro.runs.WorkerPool``, one per CPU as the command line's default ``--jobs``),
    shared by the studies' quick grids: each worker imports torch, DeepSpeed and transformers once per session."""
    from eval.repro.runs import WorkerPool  # the study driver: only a session that runs a study needs it

    with WorkerPool(max(1, os.cpu_count() or 1), tmp_path_factory.mktemp("repro-workers")) as pool:
        yield pool
