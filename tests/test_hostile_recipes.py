"""Hostile recipes (issue 19, items 5, 6 and 8; issue 17, item 3): each gave a raw traceback, or validated and
then broke or neutered the run. Now each is one paragraph naming the key (or `file:line`) and the fix, exit 2,
from `--validate` (which needs no weights) and from the run itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, TINY_HUMANLINE
from launchers.run import main

TINY_MODEL = REPO / "tests" / "fixtures" / "tiny" / "model"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _refused(capsys, argv, *needles):
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ------------------------------------------------------------------------------------------ recipe files


def test_duplicate_key_is_refused_naming_both_lines(tmp_path, capsys):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(f"defaults: [{TINY_HUMANLINE}]\ntrain:\n  lr: 1.0e-3\n  seed: 1\n  lr: 5.0\n")
    _refused(capsys, [recipe, "--validate"], f"{recipe}:5", "`lr`", "line 3", "line 5")
    _refused(capsys, [TINY_HUMANLINE, "model.config_overrides={hidden_size: 64, hidden_size: 32}", "--validate"],
             "`hidden_size`", "twice")


def test_yaml_semantics_are_otherwise_those_of_safe_load():
    from hl_core.config.load import safe_load_unique

    text = "a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\ne: [1, {f: 2}]\ng: !!str 5\n"
    import yaml

    assert safe_load_unique(text) == yaml.safe_load(text) == {
        "a": {"b": 1, "c": 2}, "d": {"b": 3, "c": 2}, "e": [1, {"f": 2}], "g": "5"}
    with pytest.raises(yaml.YAMLError):
        safe_load_unique("!!python/object/apply:os.system ['true']")


def test_recipe_that_is_not_utf8_names_its_line(tmp_path, capsys):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(f"defaults: [{TINY_HUMANLINE}]\nname: caf\xe9\n".encode("latin-1"))
    _refused(capsys, [recipe, "--validate"], f"{recipe}:2", "not UTF-8", "0xe9")


def test_recipe_path_or_defaults_entry_that_is_a_directory(tmp_path, capsys):
    _refused(capsys, [tmp_path, "--validate"], str(tmp_path), "directory")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [{TINY_HUMANLINE}, {tmp_path}]\n")
    _refused(capsys, [recipe, "--validate"], "`defaults`", str(tmp_path), "directory")


# ------------------------------------------------------------------------------------------ values

BAD_VALUES = {
    "lr infinite": (["train.lr=.inf"], ["train.lr", "finite"]),
    "beta infinite": (["objective.beta=.inf"], ["objective.beta", "finite"]),
    "adam eps infinite": (["train.adam_eps=.inf"], ["train.adam_eps", "finite"]),
    "lr nan": (["train.lr=.nan"], ["train.lr"]),
    "adam beta 1": (["train.adam_betas=[0.9,1.0]"], ["train.adam_betas", "[0, 1)"]),
    "adam beta negative": (["train.adam_betas=[-0.1,0.9]"], ["train.adam_betas"]),
    "seed too large": (["train.seed=99999999999999999999999"], ["train.seed"]),
    "seed negative": (["train.seed=-1"], ["train.seed"]),
    "rollout seed too large": (["rollout.seed=18446744073709551616"], ["rollout.seed"]),
    "unknown attention": (["model.attn_implementation=flash_attn2"],
                          ["model.attn_implementation", "flash_attention_2"]),
    "zero hidden size": (["model.config_overrides.hidden_size=0"], ["model.config_overrides.hidden_size"]),
    "negative layers": (["model.config_overrides.num_hidden_layers=-2"], ["model.config_overrides.num_hidden_layers"]),
    "vocab too small": (["model.config_overrides.vocab_size=10"], ["model.config_overrides.vocab_size", "448"]),
    "heads not a number": (["model.config_overrides.num_attention_heads=many"], ["num_attention_heads"]),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused_by_validate(case, capsys):
    overrides, needles = BAD_VALUES[case]
    _refused(capsys, [TINY_HUMANLINE, *overrides, "--validate"], *needles, "Fix")


def test_known_attention_backends_and_hub_kernels_pass():
    from hl_core.config import load_recipe

    for name in ("eager", "sdpa", "flash_attention_2", "paged|sdpa", "kernels-community/flash-attn", None):
        assert load_recipe(TINY_HUMANLINE,
                           [f"model.attn_implementation={name or 'null'}"]).model.attn_implementation == name


def test_plan_with_a_non_number_override(capsys):
    _refused(capsys, [TINY_HUMANLINE, "model.config_overrides.hidden_size=abc", "--plan"], "hidden_size")


def test_world_size_that_is_not_a_number(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    for flag in ("--validate", "--plan"):
        _refused(capsys, [TINY_HUMANLINE, flag], "WORLD_SIZE=abc", "Fix")


# ------------------------------------------------------------------------------------------ output_dir


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "run"])
def test_output_dir_that_is_a_file_or_cannot_be_created(tmp_path, capsys, validate):
    afile = tmp_path / "afile"
    afile.write_text("x")
    flag = ["--validate"] if validate else []
    _refused(capsys, [TINY_HUMANLINE, f"output_dir={afile}", *flag], "`output_dir", "is a file")
    _refused(capsys, [TINY_HUMANLINE, f"output_dir={afile}/sub", *flag], "`output_dir", "cannot be created")


def test_output_dir_not_writable(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits: make the probe fail as a read-only FS would
            import tempfile

            def refuse(*args, **kwargs):
                raise PermissionError(13, "Permission denied")

            monkeypatch.setattr(tempfile, "mkdtemp", refuse)
        _refused(capsys, [TINY_HUMANLINE, f"output_dir={locked}/run", "--validate"], "not writable", str(locked))
    finally:
        locked.chmod(0o700)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".hl-write-check")]


# ------------------------------------------------------------------------------------------ model files


def test_tokenizer_directory_without_tokenizer_files(tmp_path, capsys):
    empty = tmp_path / "tok"
    empty.mkdir()
    shutil.copy(TINY_MODEL / "config.json", empty)
    _refused(capsys, [TINY_HUMANLINE, f"model.tokenizer={empty}", "--validate"], "`model.tokenizer", "tokenizer files")


def _custom_code_model(tmp_path) -> Path:
    model = tmp_path / "custom"
    shutil.copytree(TINY_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="hlcustom", auto_map={"AutoConfig": "configuration_hl.HLConfig",
                                                   "AutoModelForCausalLM": "modeling_hl.HLModel"})
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "EXECUTED"
    (model / "configuration_hl.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return model


def test_custom_code_model_without_trust_remote_code(tmp_path, capsys):
    model = _custom_code_model(tmp_path)
    _refused(capsys, [TINY_HUMANLINE, f"model.name_or_path={model}", "--validate"], "`model.trust_remote_code")
    from hl_core.config import load_recipe
    from hl_core.errors import RecipeError
    from hl_core.models.loading import build_causal_lm

    recipe = load_recipe(TINY_HUMANLINE, [f"model.name_or_path={model}"])
    with pytest.raises(RecipeError, match="model.trust_remote_code"):  # the run's path
        build_causal_lm(recipe.model, "fp32", 0)
    assert not (tmp_path / "EXECUTED").exists()


# ------------------------------------------------------------------------------------------ resuming


def _fake_checkpoint(root: Path, files, latest=True) -> Path:
    """A checkpoints directory with one `step_3` holding empty files named as the engines name theirs."""
    step = root / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    for name in files:
        (step / name).write_text("")
    (step / "complete.json").write_text("{}")
    if latest:
        (root / "checkpoints" / "latest").write_text("step_3")
    return step


def test_resume_at_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    for flag in (["--validate"], []):
        _refused(capsys, [TINY_HUMANLINE, f"checkpoint.resume={tmp_path}", *flag], "`checkpoint.resume",
                 "not a checkpoint")
    _refused(capsys, [TINY_HUMANLINE, f"checkpoint.resume={tmp_path / 'notes.txt'}", "--validate"], "is a file")


DS0 = ["mp_rank_00_model_states.pt", "reference_rank00000.pt"]
DS2 = ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
DS3 = [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(2) for kind in ("model", "optim")]


@pytest.mark.parametrize(
    "files, overrides, world, needles",
    [
        (DS0, ["engine.zero_stage=3"], "1", ["ZeRO stage 0", "engine.zero_stage=0"]),
        (DS2, ["engine.zero_stage=0"], "2", ["ZeRO stage 1 or 2", "engine.zero_stage"]),
        (DS2, ["engine.zero_stage=2"], "1", ["2 data-parallel rank(s)", "resume with 2 process(es)"]),
        (DS3, ["engine.zero_stage=3"], "4", ["2 data-parallel rank(s)"]),
        (DS3, ["engine.zero_stage=1"], "2", ["ZeRO stage 3"]),
        (["megatron_layout.json"], [], "1", ["megatron engine", "engine.name=megatron"]),
    ],
    ids=["zero0-to-3", "zero2-to-0", "zero2-world2-to-1", "zero3-world2-to-4", "zero3-to-1", "megatron-to-deepspeed"],
)
def test_resume_with_another_zero_stage_world_size_or_engine(tmp_path, capsys, monkeypatch, files, overrides, world,
                                                             needles):
    _fake_checkpoint(tmp_path, files)
    monkeypatch.setenv("WORLD_SIZE", world)
    for flag in (["--validate"], []):
        _refused(capsys, [TINY_HUMANLINE, f"output_dir={tmp_path}", *overrides, *flag], "checkpoint.resume: auto",
                 *needles)


def test_resume_layout_checks_accept_a_matching_checkpoint(tmp_path, monkeypatch):
    from hl_core.config import check_recipe, load_recipe
    from hl_core.config.resume import MEGATRON_LAYOUT_FILE
    from hl_core.engines.megatron_checkpoint import LAYOUT_FILE

    assert MEGATRON_LAYOUT_FILE == LAYOUT_FILE
    step = _fake_checkpoint(tmp_path, DS2, latest=False)
    for stage in (1, 2):
        check_recipe(load_recipe(TINY_HUMANLINE, [f"output_dir={tmp_path}", f"engine.zero_stage={stage}"]), 2)
        check_recipe(load_recipe(TINY_HUMANLINE, [f"checkpoint.resume={step}", f"engine.zero_stage={stage}"]), 2)


def test_run_path_refuses_before_building_anything(tmp_path):
    """The same checks in a real launcher process (not --validate): exit 2, one paragraph, no traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = subprocess.run([sys.executable, str(REPO / "launchers" / "run.py"), str(TINY_HUMANLINE),
                           f"output_dir={afile}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "`output_dir" in proc.stderr, proc.stderr[-2000:]


def test_resume_refuses_an_incomplete_checkpoint_named_explicitly(tmp_path, capsys):
    """A `step_N` without `complete.json` (a save cut short, or an older version's) is never loaded by name."""
    step = _fake_checkpoint(tmp_path, DS0, latest=True)
    (step / "complete.json").unlink()
    for flag in (["--validate"], []):
        _refused(capsys, [TINY_HUMANLINE, f"checkpoint.resume={step}", *flag], "is incomplete", "complete.json")
    _refused(capsys, [TINY_HUMANLINE, f"checkpoint.resume={tmp_path / 'checkpoints'}", "--validate"],
             "no complete checkpoint")
