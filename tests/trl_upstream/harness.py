"""The pieces of the TRL-upstream harness that are not pytest hooks: the mode, the stand-ins, the data set redirect,
the swap of TRL's trainers for ours, the classification of an outcome, the CI list, and the summary.

``tests/trl_upstream/conftest.py`` wires these into pytest; ``docs/howto/trl-upstream-tests.md`` says how to run it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENDORED = HERE / "vendored"
CI_LIST = HERE / "ci_subset.txt"
ORG = "trl-internal-testing"
MODES = ("trl", "humanline")
# the test modules' own names for TRL's trainers -> our class of the same role (hl_core.integrations.trl)
SWAPS = {"DPOTrainer": "HumanlineDPOTrainer", "KTOTrainer": "HumanlineKTOTrainer",
         "GRPOTrainer": "HumanlineGRPOTrainer"}
EXPECTATIONS = ("pass", "refusal", "xfail")


def mode() -> Optional[str]:
    """``HL_TRL_UPSTREAM``: ``trl`` (TRL's own trainers, the control), ``humanline`` (ours), unset (not collected)."""
    value = os.environ.get("HL_TRL_UPSTREAM", "").strip()
    if value and value not in MODES:
        raise SystemExit(f"HL_TRL_UPSTREAM={value!r} is not a mode of the TRL-upstream harness "
                         f"(tests/trl_upstream/harness.py). Fix: set it to one of {', '.join(MODES)}, or unset it.")
    return value or None


def standins_dir() -> Path:
    """Where the stand-ins are (``HL_TRL_STANDINS``; built there on first use by ``tools/trl_standins.py``)."""
    return Path(os.environ.get("HL_TRL_STANDINS", "/tmp/hl-trl-standins"))


def _standins_module():
    spec = importlib.util.spec_from_file_location("hl_trl_standins", REPO / "tools" / "trl_standins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepare_offline_hub() -> Path:
    """Build the stand-ins if needed and point the Hugging Face libraries at them, offline.

    Must run before ``huggingface_hub`` is imported (its constants read the environment once); where it already
    is, the constants are set too.
    """
    root = _standins_module().ensure(standins_dir())
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_DATASETS_CACHE": str(root / "datasets-cache")}
    os.environ.update(env)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
        constants.HF_HUB_CACHE = env["HF_HUB_CACHE"]
    return root


def trl_compat_shims() -> List[str]:
    """Names the vendored files import from trl that the installed trl lacks, put there (version drift only).

    ``testing_utils.py`` at the pinned commit imports ``trl.import_utils.is_joblib_available``, which trl 1.16.0 no
    longer has; it only gates tests that need scikit-learn. Returns what was added.
    """
    import importlib.util as util

    import trl.import_utils as import_utils

    added = []
    if not hasattr(import_utils, "is_joblib_available"):
        import_utils.is_joblib_available = lambda: util.find_spec("joblib") is not None
        added.append("trl.import_utils.is_joblib_available")
    return added


def load_dataset_redirect(real_load_dataset, root: Path):
    """``datasets.load_dataset`` with ``trl-internal-testing/NAME`` served from ``root/datasets/NAME/CONFIG``
    (skipping the test where there is no stand-in); any other path goes to the real function."""
    import pytest
    from datasets import IterableDatasetDict, load_from_disk

    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if not str(path).startswith(f"{ORG}/"):
            return real_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
        folder = root / "datasets" / str(path).split("/", 1)[1] / str(name)
        if not folder.is_dir():
            pytest.skip(f"no stand-in for the data set {path} ({name})")
        data = load_from_disk(str(folder))
        if split is not None:
            data = data[split]
            return data.to_iterable_dataset() if streaming else data
        if streaming:
            return IterableDatasetDict({key: value.to_iterable_dataset() for key, value in data.items()})
        return data

    return load_dataset


def humanline_classes() -> Dict[str, type]:
    """TRL's trainer name -> our class, imported only in the ``humanline`` mode."""
    from hl_core.integrations import trl as ours

    return {name: getattr(ours, ours_name) for name, ours_name in SWAPS.items()}


def exception_chain(exc: BaseException) -> List[BaseException]:
    """``exc`` and every exception it was raised from or during (``__cause__``, ``__context__``)."""
    seen, stack, chain = set(), [exc], []
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        chain.append(item)
        stack.extend((item.__cause__, item.__context__))
    return chain


def refusal_in(exc: BaseException) -> Optional[BaseException]:
    """The adapter's refusal (a ``hl_core.errors.UserError``) in ``exc``'s chain, if any."""
    from hl_core.errors import UserError

    return next((e for e in exception_chain(exc) if isinstance(e, UserError)), None)


def missing_standin(exc: BaseException, root: Path, context: str = "") -> Optional[str]:
    """What an offline Hub load failed on for want of a stand-in (``None``: not that kind of failure).

    The error names no repository in some paths (transformers' "couldn't find them in the cached files"); then the
    first Hub id in ``context`` (the test's id, with its parameters) that has no stand-in is named, if any.
    """
    built = set(json.loads((root / "standins.json").read_text())["models"])
    chain = exception_chain(exc)
    offline = any(type(item).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled") or any(
        word in str(item) for word in ("offline", "cached files", "couldn't connect", "not a valid model identifier"))
        for item in chain)
    if not offline:
        return None
    names = [n.rstrip(".'") for n in re.findall(rf"{ORG}/[\w.\-]+", " ".join(map(str, chain)) + " " + context)]
    missing = [n for n in names if n not in built]
    if names and not missing:
        return None  # every id it names has a stand-in: a real failure
    return missing[0] if missing else "a Hub file (not named in the error)"


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 160 characters): the cause a failure is grouped by."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= 160 else text[:157] + "..."


@dataclass
class Expectation:
    """One line of ``ci_subset.txt``: the test, what it gives with our trainers, and for a known crash its cause."""

    test: str
    expect: str
    cause: str = ""

    @property
    def exception(self) -> type:
        """The exception class a known crash raises (a builtin named at the front of ``cause``)."""
        name = self.cause.split(":", 1)[0].strip()
        found = getattr(__import__("builtins"), name, None)
        if not (isinstance(found, type) and issubclass(found, BaseException)):
            raise SystemExit(f"{CI_LIST}: the cause of {self.test} must start with a builtin exception's name "
                             f"(`TypeError: ...`), not {name!r}. Fix: write the first line of the error.")
        return found


def read_ci_list(path: Path = CI_LIST, trl_version: str = "") -> Dict[str, Expectation]:
    """``ci_subset.txt``: ``EXPECT TEST [CAUSE]`` per line (``#`` comments), TEST as in ``vendored/``.

    ``EXPECT@SPEC`` (``refusal@<1.15``) applies only where the installed trl (``trl_version``, default: installed)
    is in the specifier set SPEC; such a line overrides the plain line of the same TEST.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    release = Version(Version(trl_version or _installed_trl()).base_version)
    found, qualified = {}, {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        expect, _, spec = parts[0].partition("@")
        if len(parts) < 2 or expect not in EXPECTATIONS or (expect == "xfail") != (len(parts) == 3):
            raise SystemExit(f"{path}:{number}: {raw!r} is not `pass TEST`, `refusal TEST` or `xfail TEST CAUSE` "
                             "(each optionally `@SPEC`, e.g. `refusal@<1.15`). Fix: write one of those (TEST as "
                             "pytest names it under vendored/).")
        if spec and release not in SpecifierSet(spec):
            continue
        (qualified if spec else found)[parts[1]] = Expectation(test=parts[1], expect=expect,
                                                               cause=parts[2] if len(parts) == 3 else "")
    return {**found, **qualified}


def _installed_trl() -> str:
    from importlib.metadata import version

    return version("trl")


def short_id(nodeid: str) -> str:
    """A node id relative to ``vendored/`` (``test_dpo_trainer.py::TestDPOTrainer::test_train``)."""
    return nodeid.split("vendored/", 1)[-1]


@dataclass
class Summary:
    """Each test's outcome in one run; ``outcome`` is passed, refusal, failed, skipped or xfailed."""

    mode: str
    trl: str
    tests: Dict[str, dict] = field(default_factory=dict)

    def add(self, test: str, outcome: str, cause: str = "", duration: float = 0.0, message: str = "") -> None:
        self.tests[test] = {"outcome": outcome, "cause": cause, "duration": round(duration, 2), "message": message}

    def counts(self) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for row in self.tests.values():
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        return dict(sorted(counts.items()))

    def causes(self, outcome: str) -> Dict[str, int]:
        """How many tests of ``outcome`` each cause accounts for, most first."""
        found: Dict[str, int] = {}
        for row in self.tests.values():
            if row["outcome"] == outcome:
                found[row["cause"]] = found.get(row["cause"], 0) + 1
        return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))

    def write(self, path: Path) -> None:
        data = asdict(self)
        data["counts"] = self.counts()
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")

    def table(self) -> List[str]:
        """The counts, then the failures' and refusals' causes, as terminal lines."""
        lines = [f"TRL upstream tests ({self.mode} trainers, trl {self.trl}): "
                 + ", ".join(f"{k} {v}" for k, v in self.counts().items())]
        for outcome in ("failed", "refusal"):
            for cause, count in self.causes(outcome).items():
                lines.append(f"  {outcome:8s} {count:4d}  {cause}")
        return lines
