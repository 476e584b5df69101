"""Runs TRL's own trainer test files (``vendored/``, unmodified) with TRL's trainers or with ours.

``HL_TRL_UPSTREAM=trl`` runs them as they are (the control); ``HL_TRL_UPSTREAM=humanline`` swaps the names the test
modules imported (``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``) for ``HumanlineDPOTrainer`` and the others at their
defaults; unset, the files are not collected (the project's own suite). Either way the Hub is replaced by local
stand-ins (``tools/trl_standins.py``), offline. Each outcome is classified (passed, refusal: our one-paragraph
``UserError``, failed, skipped, xfailed), summarised at the end as a table and written as JSON to
``$HL_TRL_UPSTREAM_REPORT`` (default ``/tmp/hl-trl-upstream-MODE.json``). ``ci_subset.txt`` lists the CI subset
(marker ``trl_ci``) with what each gives with ours; a known crash there is ``xfail(strict=True)``.
See docs/howto/trl-upstream-tests.md.
"""

import os
from pathlib import Path

import pytest

from trl_upstream import harness

MODE = harness.mode()
CI = harness.read_ci_list()
if MODE is None:
    collect_ignore = ["vendored"]
else:
    STANDINS = harness.prepare_offline_hub()
    SHIMS = harness.trl_compat_shims()


def _vendored(item) -> bool:
    return harness.VENDORED in Path(str(item.path)).parents


def pytest_configure(config):
    for name in ("slow", "low_priority"):  # the vendored files' own marks (TRL's pyproject.toml registers them)
        config.addinivalue_line("markers", f"{name}: TRL's mark")
    config.addinivalue_line("markers", "trl_ci: the CI subset of TRL's trainer tests (ci_subset.txt)")
    if MODE is not None:
        import trl

        config.stash[SUMMARY] = harness.Summary(mode=MODE, trl=trl.__version__)


SUMMARY = pytest.StashKey()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        expected = CI.get(harness.short_id(item.nodeid)) if _vendored(item) else None
        if expected is None:
            continue
        item.add_marker(pytest.mark.trl_ci)
        if MODE == "humanline" and expected.expect == "xfail":
            item.add_marker(pytest.mark.xfail(strict=True, raises=expected.exception, reason=expected.cause))


@pytest.fixture(autouse=True)
def _trl_upstream(request, monkeypatch):
    """The data set redirect and, in the ``humanline`` mode, our trainers in place of TRL's in the test module."""
    if MODE is None or not _vendored(request.node):
        yield
        return
    module = request.module
    if hasattr(module, "load_dataset"):
        monkeypatch.setattr(module, "load_dataset", harness.load_dataset_redirect(module.load_dataset, STANDINS))
    if MODE == "humanline":
        for name, cls in harness.humanline_classes().items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, cls)
    yield


def _classify(item, call, rep):
    """(outcome, cause, message) of one phase's report, rewriting it for a missing stand-in or a refusal."""
    exc = call.excinfo.value if call.excinfo is not None else None
    if rep.passed:
        return ("xpassed" if hasattr(rep, "wasxfail") else "passed"), "", ""
    if rep.skipped and hasattr(rep, "wasxfail"):
        return "xfailed", harness.first_line(exc) if exc is not None else rep.wasxfail, ""
    if rep.skipped:
        return "skipped", str(rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longrepr), ""
    if exc is None:  # a strict xfail that passed
        return "failed", str(rep.longrepr).splitlines()[0], ""
    missing = harness.missing_standin(exc, STANDINS, item.nodeid)
    if missing:
        rep.outcome, rep.longrepr = "skipped", (str(item.path), item.location[1] or 0, f"no stand-in for {missing}")
        return "skipped", f"no stand-in for {missing}", ""
    refusal = harness.refusal_in(exc) if MODE == "humanline" else None
    expected = CI.get(harness.short_id(item.nodeid))
    if refusal is not None:
        if expected is None or expected.expect == "refusal":
            rep.outcome, rep.wasxfail = "skipped", f"humanline refusal: {harness.first_line(refusal)}"
        return "refusal", harness.first_line(refusal), str(refusal)
    return "failed", harness.first_line(exc), ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if MODE is None or not _vendored(item):
        return
    if rep.when == "call" or (rep.when == "setup" and not rep.passed) or (rep.when == "teardown" and rep.failed):
        result, cause, message = _classify(item, call, rep)
        item.config.stash[SUMMARY].add(harness.short_id(item.nodeid), result, cause, rep.duration, message)


def _report_path() -> Path:
    return Path(os.environ.get("HL_TRL_UPSTREAM_REPORT", f"/tmp/hl-trl-upstream-{MODE}.json"))


def pytest_sessionfinish(session):
    if MODE is None or SUMMARY not in session.config.stash or not session.config.stash[SUMMARY].tests:
        return
    session.config.stash[SUMMARY].write(_report_path())


def pytest_terminal_summary(terminalreporter, config):
    if MODE is None or SUMMARY not in config.stash or not config.stash[SUMMARY].tests:
        return
    for line in config.stash[SUMMARY].table():
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"summary: {_report_path()}")
