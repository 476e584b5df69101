import gc
import os
import socket
from pathlib import Path

import pytest

# Under pytest-xdist (`-n 2 --dist loadfile`, what `.ci/run` runs) a test file is one unit of work, so a module-scoped
# fixture (a torchrun or a study grid shared by a file's tests) is built once, on one worker. Files that share more
# than their own fixtures are one unit together (``SAME_WORKER``), and the units that take longest go out first
# (``LONG_FIRST``, longest first, measured with `--durations`), so that they run side by side on the two workers
# instead of one of them landing last on a worker that is otherwise done; the other files follow in collection order.
SAME_WORKER = {
    # the studies' session-scoped warm-up cache and worker pool (conftest's repro_cache, repro_pool): built once
    **dict.fromkeys(("test_repro.py", "test_repro_fair.py", "test_repro_preference.py"), "repro studies"),
    # real SLURM daemons (munged, slurmctld, slurmd) and network namespaces: one live cluster at a time
    **dict.fromkeys(("test_slurm.py", "test_two_hosts.py"), "live SLURM"),
}
LONG_FIRST = ("test_repro.py", "test_repro_fair.py", "test_repro_preference.py", "test_reference_modes.py",
              "test_gpu_check.py", "test_orphans.py", "test_repro_neutral_pin.py", "test_megatron_engine.py",
              "test_resume.py", "test_speed_modes.py", "test_slurm.py", "test_two_hosts.py", "test_zero_stages.py",
              "test_token_budget.py", "test_trl_peft.py", "test_trl_resume_zero3.py")


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


@pytest.fixture
def clean_launch_env(monkeypatch):
    """No launcher variables from the outer shell."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tok():
    """The tiny model's tokenizer (tests/fixtures/tiny/model): a chat template, BOS/EOS and padding."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parent / "fixtures" / "tiny" / "model"))


@pytest.fixture
def real_model():
    """The test needs the real model's package (tests/real_model.py): without it, a skip locally, a failure under
    ``CI=true``."""
    from real_model import require_real_model

    require_real_model()


@pytest.fixture
def repo_cwd(monkeypatch):
    """The working directory at the repository: the recipes name their files relative to it."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])


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


def pytest_collection_modifyitems(config, items):
    """``LONG_FIRST``'s files at the front of the queue, in that order (stable: collection order otherwise)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: plain pytest has no such hook
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with each group of ``SAME_WORKER``'s files one unit. (Not ``loadgroup`` and ``xdist_group``
    marks: pytest-xdist 3.8 renames a marked test's ``item._nodeid``, which pytest 9 no longer reads, so the marks
    group nothing.) Any other ``--dist`` is pytest-xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # the plugin's: only a run under pytest-xdist gets here

    class FilesAndSharedUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(Path(file).name, file)

    return FilesAndSharedUnits(config, log)


def pytest_collection_finish(session):
    """Every test module is imported (torch, DeepSpeed, transformers, hl_core with them): their objects leave the
    garbage collector's view (``gc.freeze``), so that the full collection each engine's ``close`` makes after a
    run in this process scans only what the tests made since (about half a second less per run)."""
    gc.collect()
    gc.freeze()


def pytest_configure(config):
    """A pytest-xdist worker (two of them on two cores) runs torch with one intra-op thread, as every test's
    subprocess does (``helpers._env``), instead of two threads each competing for the same cores
    (``HL_TEST_WORKER_THREADS=default`` keeps torch's default, to measure the difference)."""
    if hasattr(config, "workerinput") and os.environ.get("HL_TEST_WORKER_THREADS") != "default":
        import torch  # every test imports it anyway; only a worker needs it here

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _environment_put_back():
    """Every test leaves ``os.environ`` as it found it: an in-process run sets the launcher's variables (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``: ``hl_core.engines.base.launch_environment``), which a later test
    in the same worker would read as a launch (``--validate`` refuses a partial one; a child inherits a port in use)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The tiny model (``tests/fixtures/tiny/model``) with saved random weights (seed 0), its tokenizer beside them:
    what the pack (``model.random_init=false``), the own-loop examples and the TRL adapter's tests load."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("model")
    tiny = Path(__file__).resolve().parent / "fixtures" / "tiny" / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny), dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, out / name)
    return out
