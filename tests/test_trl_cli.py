"""``python -m hl_core.integrations.trl dpo|kto|grpo``: TRL's training scripts with the humanline trainers.

* each example YAML (``examples/trl_<objective>.yaml``) runs as written from the repository: 4 updates on the tiny
  model and data, one row each;
* the same run given as flags only (every field a flag, the data a local folder through ``dataset_name``) prints
  the same per-update losses;
* a bad objective, YAML key, flag or value is one paragraph naming it (``file:line`` for a YAML key) and the fix,
  with exit code 2, before any model is loaded.
"""

import json
import re
import subprocess
import sys

import pytest
import yaml

from helpers import REPO, _env

pytest.importorskip("trl")
ROW = re.compile(r"^update (\d+)  loss (\S+)  clipped (\S+)  synced (True|False)$", re.M)


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "hl_core.integrations.trl", *map(str, args)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def rows(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = ROW.findall(proc.stdout)
    assert [int(n) for n, *_ in found] == [0, 1, 2, 3], proc.stdout[-2000:]
    return [float(loss) for _, loss, _, _ in found]


def as_flags(kind, tmp_path):
    """``examples/trl_<kind>.yaml`` as flags: each field ``--field value``; its one data source written to a local
    folder (its columns only) and named by ``--dataset_name``."""
    config = yaml.safe_load((REPO / "examples" / f"trl_{kind}.yaml").read_text())
    [source] = config.pop("datasets")
    data = tmp_path / "data"
    data.mkdir()
    lines = (REPO / source["data_files"]).read_text().splitlines()
    (data / "train.jsonl").write_text("".join(
        json.dumps({key: json.loads(line)[key] for key in source["columns"]}) + "\n" for line in lines))
    flags = ["--dataset_name", data]
    for key, value in config.items():
        flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else value]
    return flags


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo"])
def test_the_example_yaml_runs_as_written_and_flags_give_the_same_losses(kind, tmp_path):
    from_yaml = rows(cli(kind, "--config", f"examples/trl_{kind}.yaml", "--output_dir", tmp_path / "yaml"))
    from_flags = rows(cli(kind, *as_flags(kind, tmp_path), "--output_dir", tmp_path / "flags"))
    print(f"{kind}: YAML {from_yaml}, flags {from_flags}")
    assert from_yaml == from_flags
    assert len(set(from_yaml)) > 1  # it trained: the losses move


@pytest.mark.parametrize("args, says", [
    (["sft", "--config", "examples/trl_dpo.yaml"], "the first argument names the objective, one of dpo, kto, grpo"),
    (["dpo", "--config", "missing.yaml"], "`--config missing.yaml`: no such file"),
    (["dpo", "--config", "BAD.yaml"], "BAD.yaml:4`: `humanline_sync_frequency` is no field of this command. Did you "
                                      "mean `humanline_sync_freq`?"),
    (["dpo", "--config", "examples/trl_dpo.yaml", "--humanline_sync_frq", "2"], "`--humanline_sync_frq` is no flag "
                                                                                "of this command. Did you mean"),
    (["dpo", "--config", "examples/trl_dpo.yaml", "--humanline_sync_freq", "0"], "`humanline_sync_freq=0`"),
    (["grpo", "--config", "examples/trl_grpo.yaml", "--humanline_transform", "clamp"], "invalid choice: 'clamp'"),
], ids=["objective", "no-file", "yaml-key", "flag", "value", "choice"])
def test_a_bad_command_line_is_one_paragraph_and_exit_2(args, says, tmp_path):
    bad = tmp_path / "BAD.yaml"  # the DPO example with a misspelt key on line 4
    lines = (REPO / "examples" / "trl_dpo.yaml").read_text().splitlines()
    bad.write_text("\n".join(lines[:3] + ["humanline_sync_frequency: 2"] + lines[3:]) + "\n")
    proc = cli(*[str(bad) if a == "BAD.yaml" else a for a in args], "--output_dir", tmp_path / "out", timeout=300)
    error = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error.startswith("error: ") and says in error and "Fix:" in error, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
