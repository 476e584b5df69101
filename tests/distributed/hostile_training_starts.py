"""One process: the hostile cases of ``tests/test_hostile_cases.py`` that need a training start, each run through
``launchers/run.py``'s ``main`` in this process, one after the other on one process group (DeepSpeed keeps its
groups per process, so the trainers are closed without destroying it, as ``tests/distributed/lora_harness.py``
does). ``argv[1]``: a JSON file ``{"prepare": [argv...] or null, "rows": [{"id", "argv", "damage"}]}``;
``argv[2]``: where to write ``{id: {"code", "output", "checkpoint_kept"}}``.

``prepare`` is run first (a short run whose checkpoint the ``damage`` rows copy to their ``output_dir`` and
damage: ``short storage`` cuts a tensor's storage in the model-states file, ``torn heldout`` cuts the held-out
baseline file). ``output`` holds what the row printed and logged, and the traceback of anything that escaped.
"""

import contextlib
import io
import json
import logging
import shutil
import sys
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from hl_core import trainer  # noqa: E402
from launchers.run import main  # noqa: E402

_close = trainer.Trainer.close
trainer.Trainer.close = lambda self, destroy_process_group=True, **kw: _close(self, destroy_process_group=False, **kw)


def short_storage(run: Path) -> None:
    """The model-states file's largest tensor storage cut to half its bytes; the archive stays well formed."""
    path = run / "checkpoints" / "step_1" / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path) as archive:
        items = [(info, archive.read(info.filename)) for info in archive.infolist()]
    biggest = max((info.filename for info, _ in items if "/data/" in info.filename),
                  key=lambda name: len(next(data for info, data in items if info.filename == name)))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in items:
            archive.writestr(info, data[: len(data) // 2] if info.filename == biggest else data)


def torn_heldout(run: Path) -> None:
    path = run / "heldout_start_rank00000.json"
    path.write_text(path.read_text()[:20])


DAMAGE = {"short storage": short_storage, "torn heldout": torn_heldout}


def run(argv):
    """``(exit code or the escaped traceback, printed and logged text)``."""
    out, log = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
            except BaseException:  # noqa: B902 (an escaped exception is what the caller looks for)
                code = traceback.format_exc()
    finally:
        logging.getLogger().removeHandler(handler)
    return code, out.getvalue() + log.getvalue()


def main_worker(spec_path: Path, report_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    prepared = None
    if spec["prepare"]:
        code, output = run(spec["prepare"]["argv"])
        assert code == 0, output[-4000:]
        prepared = Path(spec["prepare"]["output_dir"])
    report = {}
    for row in spec["rows"]:
        if row["damage"]:
            target = Path(row["output_dir"])
            shutil.copytree(prepared, target)
            DAMAGE[row["damage"]](target)
        code, output = run(row["argv"])
        kept = bool(row["damage"]) and (Path(row["output_dir"]) / "checkpoints" / "step_1" / "complete.json").is_file()
        report[row["id"]] = {"code": code, "output": output, "checkpoint_kept": kept}
    report_path.write_text(json.dumps(report))


if __name__ == "__main__":
    main_worker(Path(sys.argv[1]), Path(sys.argv[2]))
