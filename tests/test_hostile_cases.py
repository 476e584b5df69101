"""Hostile inputs (issue 25, "One paragraph and exit 2, not a traceback"; items 2 and 3 of "Breaks by default").

One table: each row builds nothing itself, it names an entry point (``launchers/run.py``, ``python -m eval``,
``python -m eval.data_quality``, ``launchers/slurm.py``), its arguments (``{name}`` stands for a hostile file made
once by the ``hostile`` fixture) and its environment, and the words its paragraph must hold: the file
(``file:line`` where there is a line) or the recipe key, and the fix. Every row runs in this process (``main()``
returns the exit code; the eval CLIs raise ``SystemExit`` through ``exit_on_user_error``) and must exit 2 with
exactly one ``error:`` line and no traceback anywhere in its output or logs. Each row failed on the main branch
before this change (a traceback, a hang, memory eaten until killed, or a value accepted without a word).

The second table holds the cases that need a training start (an engine, rollouts, a resume): the same checks,
on the tiny recipes, in this process too (a few seconds each).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from helpers import REPO
from hostile import Row, check_refusal, fill, run_row, weights_dir

TINY = REPO / "tests" / "fixtures" / "tiny"
PAIR = {"prompt": "Describe the field.", "chosen": "It is lovely.", "rejected": "It is grim."}
DEEP = 200_000
NESTED_ANCHORS = 9  # nine anchors, each a list of nine of the previous: 9**9 values once expanded


def _jsonl(path: Path, *rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Dict[str, str]:
    """Every hostile file of the tables, by name."""
    root = tmp_path_factory.mktemp("hostile")
    p: Dict[str, Path] = {}
    # data rows: lone UTF-16 surrogates (json.dumps writes them as \ud800 escapes), depth, numbers, duplicate keys
    p["sur_prompt"] = _jsonl(root / "sur_prompt.jsonl", PAIR, dict(PAIR, prompt="Describe \ud800 the field."))
    said = [{"role": "user", "content": "Describe it."}]
    conversation = {"prompt": "Describe it.", "rejected": said + [{"role": "assistant", "content": "Grim."}],
                    "chosen": said + [{"role": "assistant", "content": "It is \udc00 lovely."}]}
    (root / "sur_messages.json").write_text(f"[\n {json.dumps(PAIR)},\n {json.dumps(conversation)}\n]\n")
    p["sur_messages"] = root / "sur_messages.json"
    p["sur_kto"] = _jsonl(root / "sur_kto.jsonl", {"prompt": "p", "completion": "a\udfff", "label": True})
    p["sur_group"] = _jsonl(root / "sur_group.jsonl",
                            {"prompt": "p", "completions": ["a", "b\ud83d"], "scores": [1, 0]})
    p["sur_math"] = _jsonl(root / "sur_math.jsonl", {"problem": "What is 1+1?", "answer": "2"},
                           {"problem": "What is \ud800+1?", "answer": "2"})
    p["deep_jsonl"] = _jsonl(root / "deep.jsonl", PAIR, "[" * DEEP + "]" * DEEP)
    (root / "deep.json").write_text("[" * DEEP + "]" * DEEP)
    p["deep_json"] = root / "deep.json"
    (root / "deep_math.jsonl").write_text('{"problem": ' + "[" * DEEP + "]" * DEEP + "}\n")
    p["deep_math"] = root / "deep_math.jsonl"
    p["big_score"] = _jsonl(root / "big_score.jsonl", '{"prompt": "p", "completions": ["a", "b"], "scores": [1, %s]}'
                            % ("9" * 400))
    p["long_score"] = _jsonl(root / "long_score.jsonl", '{"prompt": "p", "completions": ["a", "b"], "scores": [1, %s]}'
                             % ("9" * 5000))
    p["dup_jsonl"] = _jsonl(root / "dup.jsonl", PAIR, '{"prompt": "p", "chosen": "a", "rejected": "b", "chosen": "c"}')
    (root / "dup.json").write_text('[\n ' + json.dumps(PAIR) + ',\n {"prompt": "p", "chosen": "a", "prompt": "q", '
                                   '"rejected": "b"}\n]\n')
    p["dup_json"] = root / "dup.json"
    (root / "dup_alpaca.json").write_text('[{"instruction": "Say hi.", "output": "Hi.", "instruction": "x"}]')
    p["dup_alpaca"] = root / "dup_alpaca.json"
    # files that never end or block
    (root / "zero.jsonl").symlink_to("/dev/zero")
    p["zero_jsonl"] = root / "zero.jsonl"
    os.mkfifo(root / "fifo.jsonl")
    p["fifo_jsonl"] = root / "fifo.jsonl"
    (root / "zero.yaml").symlink_to("/dev/zero")
    p["zero_yaml"] = root / "zero.yaml"
    # recipes
    tiny_dpo = REPO / "recipes" / "tiny" / "offline_dpo.yaml"
    lines = [f"defaults: [{tiny_dpo}]", "model:", "  config_overrides:", "    l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, NESTED_ANCHORS)]
    (root / "bomb.yaml").write_text("\n".join(lines) + "\n")
    p["bomb_yaml"] = root / "bomb.yaml"
    (root / "deep.yaml").write_text(f"defaults: [{tiny_dpo}]\nname: " + "[" * DEEP + "]" * DEEP + "\n")
    p["deep_yaml"] = root / "deep.yaml"
    # tokenizers and chat templates (the tiny model's config, no weights)
    for name, text in (("tok_object", "{}"), ("tok_list", "[1, 2, 3]")):
        (_copy_model(TINY / "model", root / name) / "tokenizer.json").write_text(text)
        p[name] = root / name
    tok = json.loads((TINY / "model" / "tokenizer.json").read_text())
    tok["model"]["vocab"] = 5
    (_copy_model(TINY / "model", root / "tok_vocab") / "tokenizer.json").write_text(json.dumps(tok))
    p["tok_vocab"] = root / "tok_vocab"
    for name, template in (("tpl_raise", "{{ raise_exception('no conversations today') }}"),
                           ("tpl_escape", "{{ ''.__class__.__mro__[1].__subclasses__() }}")):
        (_copy_model(TINY / "model", root / name) / "chat_template.jinja").write_text(template)
        p[name] = root / name
    # model directories with weights, damaged
    good = weights_dir(root)
    p["weights"] = good
    raw = (good / "model.safetensors").read_bytes()
    header = struct.unpack("<Q", raw[:8])[0]
    damaged = {"st_cut": raw[: len(raw) // 2], "st_huge_header": struct.pack("<Q", 2**62) + raw[8:],
               "st_nul_header": raw[:8] + b"\0" * header + raw[8 + header:]}
    for name, content in damaged.items():
        (_copy_model(good, root / name) / "model.safetensors").write_bytes(content)
        p[name] = root / name
    (_copy_model(good, root / "no_config") / "config.json").unlink()
    p["no_config"] = root / "no_config"
    from safetensors.torch import load_file, save_file

    tensors = load_file(good / "model.safetensors")
    tensors["lm_head.weight"][0, 0] = float("nan")
    save_file(tensors, _copy_model(good, root / "nan_weights") / "model.safetensors", metadata={"format": "pt"})
    p["nan_weights"] = root / "nan_weights"
    (_copy_model(good, root / "weights_tpl_raise") / "chat_template.jinja").write_text("{{ raise_exception('no') }}")
    p["weights_tpl_raise"] = root / "weights_tpl_raise"
    p["root"], p["repo"] = root, REPO
    return {k: str(v) for k, v in p.items()}


R = ["recipes/tiny/offline_dpo.yaml"]
VALIDATE = ["--validate"]
MATH500 = ["--math500", "tests/fixtures/eval/math500_20.jsonl", "--limit", "2", "--max-new-tokens", "2",
           "--backend", "hf", "--offline", "--output", "{root}/eval_out"]
LAUNCH = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
TRAIN = R + ["output_dir={root}/run", "logging.progress_bar=false"]

ROWS = [
    # lone UTF-16 surrogates: --validate (each data kind), rollout prompts, data-quality
    Row("surrogate prompt", "run", R + ["data.train.path={sur_prompt}"] + VALIDATE,
        ["{sur_prompt}:2", "`prompt`", "surrogate", "Fix"]),
    Row("surrogate in a message", "run", R + ["data.train.path={sur_messages}"] + VALIDATE,
        ["{sur_messages}:3 (row 1)", "`chosen[1].content`", "surrogate"]),
    Row("surrogate kto completion", "run", ["recipes/tiny/offline_kto.yaml", "data.train.path={sur_kto}"] + VALIDATE,
        ["{sur_kto}:1", "`completion`", "surrogate"]),
    Row("surrogate grpo completion", "run", ["recipes/tiny/offline_grpo.yaml", "data.train.path={sur_group}"]
        + VALIDATE, ["{sur_group}:1", "`completions[1]`", "surrogate"]),
    Row("surrogate rollout prompt", "run", ["recipes/tiny/online_grpo_math.yaml", "data.train.path={sur_math}"]
        + VALIDATE, ["{sur_math}:2", "`problem`", "surrogate"]),
    Row("surrogate data quality", "data_quality", ["{sur_prompt}", "--model", "{weights}"],
        ["{sur_prompt}:2", "`prompt`", "surrogate"]),
    # depth, numbers, duplicate keys
    Row("200000-deep jsonl", "run", R + ["data.train.path={deep_jsonl}"] + VALIDATE, ["{deep_jsonl}:2", "nested"]),
    Row("200000-deep json", "run", R + ["data.train.path={deep_json}"] + VALIDATE, ["{deep_json}", "nested"]),
    Row("integer score beyond float", "run", ["recipes/tiny/offline_grpo.yaml", "data.train.path={big_score}"]
        + VALIDATE, ["{big_score}:1", "`scores[1]`", "400 digits", "float32"]),
    Row("integer score of 5000 digits", "run", ["recipes/tiny/offline_grpo.yaml", "data.train.path={long_score}"]
        + VALIDATE, ["{long_score}:1", "digits", "Fix"]),
    Row("duplicate key jsonl", "run", R + ["data.train.path={dup_jsonl}"] + VALIDATE,
        ["{dup_jsonl}:2", "`chosen`", "twice"]),
    Row("duplicate key json", "run", R + ["data.train.path={dup_json}"] + VALIDATE,
        ["{dup_json}:3 (row 1)", "`prompt`", "twice"]),
    Row("duplicate key alpaca data", "eval", ["{weights}", "--alpaca", "{dup_alpaca}", "--judge", "py:builtins:max",
                                               "--offline", "--output", "{root}/eval_out"],
        ["{dup_alpaca}:1 (row 0)", "`instruction`", "twice"]),
    # files that never end or block
    Row("data file is /dev/zero", "run", R + ["data.train.path={zero_jsonl}"] + VALIDATE,
        ["zero.jsonl", "character device", "not a regular file"]),
    Row("data file is a fifo", "run", R + ["data.train.path={fifo_jsonl}"] + VALIDATE,
        ["data.train.path", "FIFO", "not a regular file"]),
    Row("recipe is /dev/zero", "run", ["/dev/zero", "--print-config"], ["/dev/zero", "not a regular file"]),
    Row("recipe links to /dev/zero", "run", ["{zero_yaml}", "--validate"], ["/dev/zero", "not a regular file"]),
    # YAML
    Row("alias bomb print-config", "run", ["{bomb_yaml}", "--print-config"], ["{bomb_yaml}", "aliases", "100,000"]),
    Row("alias bomb validate", "run", ["{bomb_yaml}", "--validate"], ["{bomb_yaml}", "aliases", "100,000"]),
    Row("alias bomb in an override", "run", R + ["model.config_overrides={a: &a [x,x,x,x,x,x,x,x,x,x], b: &b "
                                                 + "[" + ",".join(["*a"] * 10) + "], c: &c [" + ",".join(["*b"] * 10)
                                                 + "], d: &d [" + ",".join(["*c"] * 10) + "], e: ["
                                                 + ",".join(["*d"] * 10) + "]}", "--print-config"],
        ["model.config_overrides", "aliases", "100,000"]),
    Row("200000-deep recipe", "run", ["{deep_yaml}", "--print-config"], ["{deep_yaml}", "deeper", "Fix"]),
    Row("python tag in an override", "run", R + ["model.config_overrides.x=!!python/object/apply:os.system [true]",
                                                 "--print-config"],
        ["model.config_overrides.x", "tag", "python/object/apply:os.system"]),
    Row("local tag in an override", "run", R + ["name=!secret", "--validate"], ["`name`", "tag", "quote"]),
    # tokenizers and chat templates
    Row("tokenizer.json an empty object", "run", R + ["model.name_or_path={tok_object}"] + VALIDATE,
        ["model.name_or_path", "{tok_object}", "tokenizer.json", "Fix"]),
    Row("tokenizer.json a list", "run", R + ["model.name_or_path={tok_list}"] + VALIDATE,
        ["model.name_or_path", "{tok_list}", "tokenizer.json"]),
    Row("tokenizer.json of a wrong shape", "run", R + ["model.name_or_path={tok_vocab}"] + VALIDATE,
        ["model.name_or_path", "{tok_vocab}", "tokenizer.json"]),
    Row("chat template raises", "run", R + ["model.name_or_path={tpl_raise}"] + VALIDATE,
        ["tests/fixtures/tiny/prefs/train.jsonl:1", "{tpl_raise}", "no conversations today", "Fix"]),
    Row("chat template sandbox escape", "run", R + ["model.name_or_path={tpl_escape}"] + VALIDATE,
        ["tests/fixtures/tiny/prefs/train.jsonl:1", "sandbox", "__class__", "nothing of it ran"]),
    Row("data.chat_template raises", "run", R + ["data.chat_template={{ raise_exception('refused') }}"] + VALIDATE,
        ["tests/fixtures/tiny/prefs/train.jsonl:1", "`data.chat_template`", "refused"]),
    Row("chat template raises in data quality", "data_quality",
        ["tests/fixtures/tiny/prefs/train.jsonl", "--model", "{weights_tpl_raise}", "--limit", "2"],
        ["tests/fixtures/tiny/prefs/train.jsonl:1", "{weights_tpl_raise}", "chat template"]),
    # the launch environment
    Row("RANK=abc", "run", TRAIN, ["`RANK=abc`", "torchrun"], env={"RANK": "abc"}),
    Row("MASTER_PORT=abc", "run", TRAIN, ["`MASTER_PORT=abc`", "port"], env={"MASTER_PORT": "abc"}),
    Row("RANK and WORLD_SIZE without LOCAL_RANK", "run", TRAIN, ["RANK=0, WORLD_SIZE=1", "LOCAL_RANK", "MPI"],
        env={"RANK": "0", "WORLD_SIZE": "1", **LAUNCH}),
    Row("RANK=1 WORLD_SIZE=1", "run", TRAIN, ["RANK=1", "WORLD_SIZE=1", "wait"],
        env={"RANK": "1", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **LAUNCH}),
    Row("WORLD_SIZE=2 alone", "run", TRAIN, ["WORLD_SIZE=2", "RANK", "LOCAL_RANK"], env={"WORLD_SIZE": "2"}),
    # model directories given to eval and to training
    Row("safetensors cut short (eval)", "eval", ["{st_cut}"] + MATH500, ["{st_cut}/model.safetensors", "cut short"]),
    Row("safetensors huge header (eval)", "eval", ["{st_huge_header}"] + MATH500,
        ["{st_huge_header}/model.safetensors", "header claims"]),
    Row("safetensors NUL header (eval)", "eval", ["{st_nul_header}"] + MATH500,
        ["{st_nul_header}/model.safetensors", "not JSON"]),
    Row("no config.json (eval)", "eval", ["{no_config}"] + MATH500, ["{no_config}", "config.json"]),
    Row("NaN weights (eval)", "eval", ["{nan_weights}"] + MATH500, ["{nan_weights}", "NaN", "`lm_head.weight`"]),
    Row("NaN weights (data quality)", "data_quality", ["tests/fixtures/tiny/prefs/train.jsonl", "--model",
                                                       "{nan_weights}", "--limit", "2"], ["{nan_weights}", "NaN"]),
    Row("safetensors cut short (validate)", "run", R + ["model.name_or_path={st_cut}", "model.random_init=false"]
        + VALIDATE, ["model.name_or_path", "{st_cut}/model.safetensors", "cut short"]),
    Row("eval data nested too deep", "eval", ["{weights}", "--math500", "{deep_math}", "--offline", "--output",
                                              "{root}/eval_out"], ["{deep_math}:1", "nested"]),
    # launchers
    Row("slurm --stop-before -600", "slurm", R + ["--dry-run", "--stop-before", "-600"], ["--stop-before -600"]),
    Row("slurm --stop-before 0", "slurm", R + ["--dry-run", "--stop-before", "0"], ["--stop-before 0", "1 to"]),
    # item 2: megatron-core not installed
    Row("megatron-core not installed", "run", ["recipes/gemma2_27b_humanline_dpo.yaml", "--validate"],
        ["megatron-core", "pip install -e .[megatron]"], hide=("megatron",)),
    # item 3: the default AlpacaEval judge without its API key, with a relative output directory
    Row("alpaca API judge without a key", "eval", ["{weights}", "--alpaca",
                                                   "{repo}/tests/fixtures/eval/alpaca_eval_6.json", "--offline",
                                                   "--output", "relative_eval_out"],
        ["api:weighted_alpaca_eval_gpt-4.1", "`OPENAI_API_KEY`", "Nothing was generated"],
        env={"OPENAI_API_KEY": "", "OPENAI_API_KEYS": "", "OPENAI_CLIENT_CONFIG_PATH": "{root}/no_client_config.yaml"},
        absent=("{root}/relative_eval_out/alpaca_model_outputs.json",), cwd="{root}"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_input_is_one_paragraph_and_exit_2(row, hostile, clean_launch_env, monkeypatch, capsys, caplog):
    monkeypatch.chdir(fill(row.cwd, hostile))
    code, output = run_row(row, hostile, monkeypatch, capsys, caplog)
    check_refusal(row, code, output, hostile)


# ------------------------------------------------------------------------------------------ a training start

REWARDS = """
def nan_scores(prompts, completions, references):
    return [float("nan")] * len(completions)


def text_scores(prompts, completions, references):
    return ["1.0"] * len(completions)
"""
ONLINE = ["recipes/tiny/online_grpo_math.yaml", "logging.progress_bar=false"]
# one update of the tiny online GRPO recipe with a held-out evaluation at its start: a complete checkpoint (step_1)
# and the held-out baseline file beside it, for the resume rows to copy and damage
PREPARE = ONLINE + ["output_dir={root}/online", "train.max_steps=1", "checkpoint.save_every=1", "eval.every=1"]

TRAINING_ROWS = [
    Row("surrogate prompt (training)", "run", TRAIN + ["data.train.path={sur_prompt}"],
        ["{sur_prompt}:2", "`prompt`", "surrogate"]),
    Row("random-init model beyond memory", "run", TRAIN + [
        "model.config_overrides={hidden_size: 8192, intermediate_size: 1048576, num_hidden_layers: 64}"],
        ["model.random_init", "model.config_overrides", "GiB", "Nothing was allocated"]),
    Row("reward callable returns NaN", "run", ONLINE + ["output_dir={root}/nan_reward", "rollout.reward.kind=callable",
                                                        "rollout.reward.function=hostile_rewards:nan_scores"],
        ["`rollout.reward.function`", "nan", "finite"]),
    Row("reward callable returns text", "run", ONLINE + ["output_dir={root}/text_reward",
                                                         "rollout.reward.kind=callable",
                                                         "rollout.reward.function=hostile_rewards:text_scores"],
        ["`rollout.reward.function`", "'1.0'", "str"]),
    Row("torn heldout_start file", "run", ONLINE + ["output_dir={root}/torn", "train.max_steps=2", "eval.every=1"],
        ["{root}/torn/heldout_start_rank00000.json", "damaged", "Fix"]),
    Row("checkpoint tensor with a short storage", "run", ONLINE + ["output_dir={root}/short", "train.max_steps=2"],
        ["{root}/short/checkpoints/step_1/mp_rank_00_model_states.pt", "damaged or truncated"]),
]
DAMAGE = {"torn heldout_start file": "torn heldout", "checkpoint tensor with a short storage": "short storage"}


@pytest.fixture(scope="module")
def training_starts(hostile):
    """The rows of ``TRAINING_ROWS`` run by one worker process (``tests/distributed/hostile_training_starts.py``):
    their exit codes and output, and whether a damaged checkpoint survived its refusal."""
    root = Path(hostile["root"])
    (root / "hostile_rewards.py").write_text(REWARDS)
    rows = [{"id": r.id, "argv": [fill(a, hostile) for a in r.argv], "damage": DAMAGE.get(r.id),
             "output_dir": fill(next(a for a in r.argv if a.startswith("output_dir=")), hostile)[len("output_dir="):]}
            for r in TRAINING_ROWS]
    spec = {"prepare": {"argv": [fill(a, hostile) for a in PREPARE], "output_dir": f"{root}/online"}, "rows": rows}
    (root / "training_starts.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "distributed" / "hostile_training_starts.py"),
                           str(root / "training_starts.json"), str(root / "training_results.json")], cwd=REPO,
                          env={**env, "PYTHONPATH": f"{root}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((root / "training_results.json").read_text())


@pytest.mark.parametrize("row", TRAINING_ROWS, ids=[r.id for r in TRAINING_ROWS])
def test_hostile_training_start_is_one_paragraph_and_exit_2(row, hostile, training_starts):
    result = training_starts[row.id]
    check_refusal(row, result["code"], result["output"], hostile)
    if row.id in DAMAGE:  # nothing lost: the checkpoint it was refused from is still there
        assert result["checkpoint_kept"]


# ------------------------------------------------------------------------------------------ what stays accepted


def test_valid_inputs_next_to_the_refused_ones_still_load(tmp_path):
    """The checks refuse only what the rows above show: escaped surrogate pairs (json.dumps writes an emoji so),
    scores at float32's edge, the same key in two objects, small aliases, Jinja braces and standard tags in an
    override, a symlink to a regular file."""
    import torch

    from hl_core.config.load import load_recipe, parse_override, safe_load_unique
    from hl_core.data import load_group_records, load_preference_records
    from hl_core.rollout.rewards import CallableReward

    emoji = _jsonl(tmp_path / "emoji.jsonl", dict(PAIR, prompt="Smile \U0001F600", chosen="a\U0001F600"))
    assert "\\ud83d\\ude00" in emoji.read_text()
    (record,) = load_preference_records(emoji)
    assert record.prompt[0]["content"] == "Smile \U0001F600" and record.chosen == "a\U0001F600"
    (tmp_path / "list.json").write_text(json.dumps([PAIR, {"prompt": [{"role": "user", "content": "q"}],
                                                            "chosen": "a", "rejected": "b"}]))
    assert len(load_preference_records(tmp_path / "list.json")) == 2
    edge = _jsonl(tmp_path / "edge.jsonl", {"prompt": "p", "completions": ["a", "b"], "scores": [3 * 10**38, -1]})
    assert load_group_records(edge)[0].scores == [3e38, -1.0]
    (tmp_path / "link.jsonl").symlink_to(emoji)
    assert len(load_preference_records(tmp_path / "link.jsonl")) == 1
    assert safe_load_unique("a: &x [1, 2]\nb: [*x, *x]\nc: !!str 5\n") == {"a": [1, 2], "b": [[1, 2], [1, 2]], "c": "5"}
    assert parse_override("data.chat_template={{ messages[0]['content'] }}") == (
        ["data", "chat_template"], "{{ messages[0]['content'] }}")
    assert parse_override("name=!!str 12") == (["name"], "12")
    assert parse_override("name=a: b: c") == (["name"], "a: b: c")  # not YAML at all: the text as it is
    assert load_recipe(REPO / "recipes" / "tiny" / "offline_dpo.yaml", ["name=x"]).name == "x"
    reward = CallableReward.__new__(CallableReward)
    reward.fn = lambda p, c, r: [1, 0.5, torch.tensor(2.0)]
    assert reward(None, ["a", "b", "c"], None) == [1.0, 0.5, 2.0]


@pytest.mark.parametrize("env", [
    {},
    {"WORLD_SIZE": "1"},
    {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "29500"},
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
], ids=["none", "leftover WORLD_SIZE=1", "one process with a port", "torchrun rank 1 of 2"])
def test_launch_environments_of_real_launchers_pass(env):
    from hl_core.engines.base import check_launch_environment

    check_launch_environment(env)


@pytest.mark.parametrize("manifest", ['[]', '{"fingerprint": 3}', '{"fingerprint": {}, "parts": {"x": 5}}',
                                      '{"fingerprint": {}, "parts": []}', "[" * DEEP + "]" * DEEP],
                         ids=["list", "fingerprint a number", "part a number", "parts a list", "200000 deep"])
def test_reference_cache_manifest_of_another_shape_is_recomputed(tmp_path, manifest):
    """The cache is derived data: a manifest it did not write (the wrong shape) is unreadable, as a torn one is,
    and the rank's cache is computed again with a notice (no traceback, no exit: the run goes on)."""
    from hl_core.reference.cache import ReferenceCacheDir

    (tmp_path / "manifest.json").write_text(manifest)
    cache = ReferenceCacheDir(tmp_path, {"format": 1})
    assert cache.parts == {} and len(cache.notices) == 1 and "unreadable" in cache.notices[0]
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"fingerprint": {"format": 1}, "parts": {}}
