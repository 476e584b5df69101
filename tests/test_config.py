"""Recipe loading, inheritance, overrides, and the one-paragraph errors of `run.py --validate` (exit 2)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import start_model_overrides
from hl_core.config import apply_overrides, deep_merge, load_recipe
from launchers.run import main

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny" / "humanline_dpo.yaml"


pytestmark = pytest.mark.usefixtures("repo_cwd")  # the recipes name their files relative to the repository


def _write(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _tiny_child(tmp_path, body=""):
    return _write(tmp_path, f"defaults: [{TINY}]\n" + textwrap.dedent(body))


def test_tiny_recipes_load_with_inheritance():
    recipe = load_recipe(TINY)
    assert recipe.objective.name == "dpo" and recipe.objective.beta == 0.1
    assert recipe.humanline.transform == "clip" and recipe.humanline.sync_every == 1
    assert recipe.engine.zero_stage == 0 and recipe.engine.precision == "fp32"
    assert recipe.name == "humanline_dpo"
    plain = load_recipe(REPO / "recipes" / "tiny" / "offline_dpo.yaml")
    assert plain.humanline.transform == "none" and plain.humanline.sync_every is None


def test_overrides_parse_yaml_values():
    recipe = load_recipe(TINY, ["engine.zero_stage=3", "humanline.sync_every=null", "train.lr=5e-4", "objective=dpo"])
    assert recipe.engine.zero_stage == 3 and recipe.humanline.sync_every is None and recipe.train.lr == 5e-4


def test_deep_merge_and_override_helpers():
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}
    assert apply_overrides({"a": {"b": 1}}, ["a.c.d=[1, 2]"]) == {"a": {"b": 1, "c": {"d": [1, 2]}}}


def test_validate_ok(capsys):
    assert main([str(TINY), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "is valid" in out and "train rows" in out


BAD_RECIPES = {
    "unknown key with suggestion": ("train:\n  max_step: 3\n", ["train.max_step", "max_steps"]),
    "unknown group with suggestion": ("humanlin:\n  sync_every: 2\n", ["humanlin", "humanline"]),
    "wrong type": ("train:\n  lr: fast\n", ["train.lr", "number"]),
    "zero stage out of range": ("engine:\n  zero_stage: 5\n", ["engine.zero_stage"]),
    "unknown objective": ("objective:\n  name: dpoo\n", ["objective.name", "dpo"]),
    "unknown transform": ("humanline:\n  transform: clipp\n", ["humanline.transform", "clip"]),
    "positive lower clip bound": ("humanline:\n  log_eps_P: 0.5\n", ["humanline.log_eps_P"]),
    "prompt longer than sequence": ("data:\n  max_prompt_length: 64\n", ["max_prompt_length", "max_length"]),
    # removed until reference caching exists: an old recipe that sets it is told the key is unknown
    "removed reference cache key": ("train:\n  cache_reference_logps: true\n", ["train.cache_reference_logps"]),
    "eval without data": ("data:\n  eval: null\neval:\n  every: 5\n", ["eval.every", "data.eval"]),
    "tensor parallel on deepspeed": ("parallel:\n  tp: 2\n", ["parallel.tp", "megatron"]),
    "missing data file": ("data:\n  train:\n    path: nope/missing.jsonl\n", ["data.train.path", "nope/missing.jsonl"]),
    "both path and name": ("data:\n  train:\n    name: some/set\n", ["data.train", "exactly one"]),
    "global batch not a multiple": ("train:\n  global_batch_size: 12\n", ["global_batch_size", "micro_batch_size"]),
    "resume path missing": ("checkpoint:\n  resume: /nonexistent/ckpt\n", ["checkpoint.resume"]),
    "local model missing": ("model:\n  name_or_path: ./no/such/model\n", ["model.name_or_path"]),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_bad_recipe_exits_2_with_one_paragraph(case, tmp_path, capsys):
    body, needles = BAD_RECIPES[case]
    path = _tiny_child(tmp_path, body)
    assert main([str(path), "--validate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert err.strip().count("\n") == 0, "one paragraph"
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Fix" in err or "Did you mean" in err


def test_missing_required_key(tmp_path, capsys):
    path = _write(tmp_path, f"""
        defaults: [{REPO / 'recipes/_base/dpo.yaml'}]
        model: {{name_or_path: tests/fixtures/tiny/model}}
        data: {{train: {{path: tests/fixtures/tiny/prefs/train.jsonl}}}}
        train: {{lr: 1.0e-3}}
    """)
    assert main([str(path), "--validate"]) == 2
    err = capsys.readouterr().err
    # `train.max_steps` or its alternative `train.epochs`: exactly one is required
    assert "set exactly one of `train.max_steps` (updates) and `train.epochs`" in err and "neither is set" in err


@pytest.mark.parametrize(
    "text, needle",
    [
        ("model: [unclosed\n", "not valid YAML"),
        ("- a\n- b\n", "must be a YAML mapping"),
        ("defaults: [missing_base.yaml]\n", "missing_base.yaml"),
    ],
)
def test_bad_files(tmp_path, capsys, text, needle):
    assert main([str(_write(tmp_path, text)), "--validate"]) == 2
    assert needle in capsys.readouterr().err


def test_defaults_loop_and_bad_override(tmp_path, capsys):
    _write(tmp_path, "defaults: [b.yaml]\n", "a.yaml")
    _write(tmp_path, "defaults: [a.yaml]\n", "b.yaml")
    assert main([str(tmp_path / "a.yaml"), "--validate"]) == 2
    assert "loops" in capsys.readouterr().err
    assert main([str(TINY), "train.lr"]) == 2
    assert "has no `=`" in capsys.readouterr().err
    assert main([str(tmp_path / "none.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_bad_data_row_fails_validate(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "hi", "chosen": "a", "rejected": "b"}\n{"prompt": "hi", "chosen": "a"}\n')
    path = _tiny_child(tmp_path, f"data:\n  train:\n    path: {data}\n")
    assert main([str(path), "--validate"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2" in err and "rejected" in err


def test_cli_exit_code_and_no_traceback(tmp_path):
    path = _tiny_child(tmp_path, "train:\n  max_step: 3\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "launchers" / "run.py"), str(path), "--validate"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "Did you mean `max_steps`?" in proc.stderr


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_exit_after_teardown_keeps_output_and_code(world_size):
    """Multi-rank runs end with ``os._exit``: buffered stdout/stderr and logging still reach the caller, and
    the exit code is the one ``main`` returned."""
    script = (
        "import logging, sys; from launchers.run import exit_after_teardown; "
        "logging.basicConfig(stream=sys.stderr); print('tail without newline', end=''); "
        "logging.getLogger('t').warning('logged'); exit_after_teardown(3)"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # stdout stays buffered
    env["WORLD_SIZE"] = world_size
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 3
    assert proc.stdout == "tail without newline" and "logged" in proc.stderr


def test_every_recipe_validates():
    recipes = [p for p in (REPO / "recipes").rglob("*.yaml") if "_base" not in p.parts and not p.name.startswith("_")]
    assert recipes
    for path in recipes:
        assert main([str(path), "--validate", *start_model_overrides(path)]) == 0, path


def test_recipe_starting_from_an_unrun_model_says_which_run_to_train_first(capsys):
    assert main([str(REPO / "recipes" / "repro" / "online.yaml"), "--validate",
                 "model.name_or_path=runs/never-trained-here/final"]) == 2
    err = capsys.readouterr().err
    assert "train that run first" in err and "recipes/repro/warmup.yaml" in err


@pytest.mark.parametrize(
    "lines, line_no, needle",
    [
        (['{"prompt": "p", "chosen": "a", "rejected": "b"}', '{"prompt": "p", "chosen": "a"}'], 2, "rejected"),
        (['{"prompt": "p", "chosen": "a", "rejected": "b"}', '{"prompt": "p", "chosen": "  ", "rejected": "b"}'], 2,
         "chosen"),
        (['{"prompt": "p", "chosen": 3, "rejected": "b"}'], 1, "chosen"),
        (['{"prompt": "p", "chosen": "a", "rejected": "b"}', '{"prompt": "p", "chosen": "a", '], 2, "JSON"),
    ],
    ids=["missing field", "empty completion", "wrong type", "malformed JSON"],
)
def test_bad_data_rows_exit_2_naming_file_line(tmp_path, capsys, lines, line_no, needle):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(lines) + "\n")
    path = _tiny_child(tmp_path, f"data:\n  train:\n    path: {data}\n")
    assert main([str(path), "--validate"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:{line_no}" in err and needle in err and "Traceback" not in err


def test_every_key_documented_and_reference_in_sync():
    from hl_core.config import Recipe, recipe_keys_markdown
    from hl_core.config.load import _unwrap_model

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            sub = _unwrap_model(field.annotation)
            if sub is None or sub is Recipe:
                assert field.description, f"{prefix}{name} has no description"
            if sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(Recipe)
    from hl_core.config import OBJECTIVE_CONFIGS

    for cls in OBJECTIVE_CONFIGS.values():
        walk(cls, "objective.")
    committed = (REPO / "docs" / "recipe-keys.md").read_text()
    assert committed.strip() == recipe_keys_markdown().strip(), (
        "regenerate: python -m hl_core.config > docs/recipe-keys.md")


def test_objective_data_mismatches_fail_validate(tmp_path, capsys):
    unlabeled = tmp_path / "unlabeled.jsonl"
    unlabeled.write_text('{"prompt": "p", "completion": "a"}\n')
    path = _tiny_child(tmp_path, f"objective: kto\ndata:\n  train:\n    path: {unlabeled}\n")
    assert main([str(path), "--validate"]) == 2
    err = capsys.readouterr().err
    assert f"{unlabeled}:1" in err and "label" in err

    singleton = tmp_path / "single.jsonl"
    singleton.write_text('{"prompt": "p", "completions": ["a"], "scores": [1.0]}\n')
    path = _tiny_child(tmp_path, f"objective: grpo\ndata:\n  train:\n    path: {singleton}\n")
    assert main([str(path), "--validate"]) == 2
    err = capsys.readouterr().err
    assert f"{singleton}:1" in err and "group" in err.lower()

    path = _tiny_child(tmp_path, "humanline:\n  transform: sampling\n")
    assert main([str(path), "--validate"]) == 2
    assert "Did you mean `sample`?" in capsys.readouterr().err


def test_objective_switch_and_objective_specific_keys(tmp_path, capsys):
    assert main([str(TINY), "objective=grpo", "--validate"]) == 0  # shorthand replaces the whole block
    capsys.readouterr()
    assert main([str(TINY), "objective.name=grpo", "--validate"]) == 2  # keeps DPO's beta
    err = capsys.readouterr().err
    assert "`objective.beta` for objective `grpo`" in err
    assert main([str(TINY), "objective=kto", "objective.eps_low=0.1", "--validate"]) == 2
    assert "for objective `kto`" in capsys.readouterr().err
