"""The hostile-input tables' machinery (tests/test_hostile_*.py, tests/test_disk_full.py): a row names an entry point,
its arguments and environment, and the words its one-paragraph refusal must hold; ``run_row`` runs it in this process
and ``check_refusal`` checks exit 2, exactly one ``error:`` line and no traceback."""

from __future__ import annotations

import logging
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Sequence, Tuple

from helpers import REPO
from hl_core.errors import exit_on_user_error

TINY = REPO / "tests" / "fixtures" / "tiny"


@dataclass
class Row:
    id: str
    entry: str  # "run" | "eval" | "data_quality" | "slurm"
    argv: Sequence[str]
    words: Sequence[str]  # in the paragraph; "{name}" as in argv
    env: Dict[str, str] = field(default_factory=dict)  # "" unsets
    hide: Tuple[str, ...] = ()  # packages made unimportable, as if not installed
    absent: Tuple[str, ...] = ()  # paths that must not exist afterwards (nothing generated, nothing written)
    cwd: str = "{repo}"  # the working directory (the recipes name their files relative to the repository)


def fill(text: str, files: Dict[str, str]) -> str:
    """``text`` with each ``{name}`` of ``files`` replaced (other braces, as in YAML or Jinja, stay)."""
    return re.sub(r"\{(\w+)\}", lambda m: files.get(m.group(1), m.group(0)), text)


def weights_dir(root: Path) -> Path:
    """A tiny Llama with weights and the tiny tokenizer, saved like a run's ``final/``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    out = root / "weights"
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(TINY / "model")).save_pretrained(out)
    AutoTokenizer.from_pretrained(TINY / "model").save_pretrained(out)
    return out


class _Hidden:
    """A meta-path finder that makes packages unimportable, as when they are not installed."""

    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _entry(name):
    if name == "run":
        from launchers.run import main
    elif name == "slurm":
        from launchers.slurm import main
    elif name == "eval":
        from eval.__main__ import main
    else:
        from eval.data_quality import main
    return main


def run_row(row: Row, files: Dict[str, str], monkeypatch, capsys, caplog) -> Tuple[object, str]:
    """Run ``row`` in this process; ``(exit code, everything it printed and logged)``. An exception that escapes
    the entry point is returned as its traceback, as a user would see it."""
    for name, value in row.env.items():
        if value:
            monkeypatch.setenv(name, fill(value, files))
        else:
            monkeypatch.delenv(name, raising=False)
    if row.hide:
        for module in [m for m in sys.modules if m.split(".")[0] in row.hide]:
            monkeypatch.delitem(sys.modules, module)
        monkeypatch.setattr(sys, "meta_path", [_Hidden(row.hide)] + sys.meta_path)
    argv = [fill(a, files) for a in row.argv]
    caplog.set_level(logging.WARNING)
    try:
        try:
            main = _entry(row.entry)
            code = main(argv) if row.entry in ("run", "slurm") else exit_on_user_error(main, argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # noqa: B902 (a traceback is the failure this table looks for)
            code = traceback.format_exc()
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a run refused after its process group came up
            dist.destroy_process_group()
    out = capsys.readouterr()
    return code, out.out + out.err + caplog.text


def check_refusal(row: Row, code, output: str, files: Dict[str, str]) -> None:
    assert code == 2, f"exit {code!r}, expected 2:\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    for word in row.words:
        assert fill(word, files) in errors[0], (fill(word, files), errors[0])
    for path in row.absent:
        assert not Path(fill(path, files)).exists(), path


