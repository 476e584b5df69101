"""The harness that runs TRL's own trainer tests (``tests/trl_upstream``): its vendored copies, its stand-ins, its
data set redirect, its classification of outcomes and its CI list. (The runs themselves: ``.ci/run``'s TRL block and
docs/howto/trl-upstream-tests.md.)"""

import ast
import importlib.util
import json
import subprocess
import sys

import pytest

from helpers import REPO
from trl_upstream import harness


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"hl_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vendor = _tool("trl_vendor")
standins = _tool("trl_standins")


def test_vendored_files_are_trls_bytes():
    assert vendor.check_copies() == []


def test_blob_id_is_gits(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"# Copyright\n\x00binary\n")
    git = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout.strip()
    assert vendor.git_blob_id(path.read_bytes()) == git


def test_an_edited_copy_is_named(tmp_path):
    for name in vendor.BLOBS:
        (tmp_path / name).write_bytes((vendor.VENDORED / name).read_bytes())
    (tmp_path / "testing_constants.py").write_bytes(b"# edited\n")
    (tmp_path / "extra.py").write_text("")
    problems = vendor.check_copies(tmp_path)
    assert [p.split(":")[0] for p in problems] == ["testing_constants.py", "extra.py"]


# upstream's column names per configuration (scripts/generate_zen_dataset.py at the pinned commit)
ZEN_COLUMNS = {
    "standard_prompt_only": ["prompt"], "standard_preference": ["prompt", "chosen", "rejected"],
    "standard_implicit_prompt_preference": ["chosen", "rejected"],
    "standard_unpaired_preference": ["prompt", "completion", "label"],
    "conversational_prompt_only": ["prompt"], "conversational_preference": ["prompt", "chosen", "rejected"],
    "conversational_implicit_prompt_preference": ["chosen", "rejected"],
    "conversational_unpaired_preference": ["prompt", "completion", "label"],
}


def test_zen_configs_have_upstreams_columns_and_rows():
    configs = standins.zen_configs()
    for name, columns in ZEN_COLUMNS.items():
        assert list(configs[name]) == columns, name
        assert {len(v) for v in configs[name].values()} == {19}, name
    assert standins.zen_lines()[0] == "Beautiful is better than ugly."
    row = configs["conversational_preference"]
    assert row["prompt"][0] == [{"role": "user", "content": "Beautiful is"}]
    assert row["chosen"][0] == [{"role": "assistant", "content": "better than ugly."}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("standins")
    standins.build_datasets(root)
    return root


def test_load_dataset_redirect(saved):
    def real(*args, **kwargs):
        return ("real", args, kwargs)

    load = harness.load_dataset_redirect(real, saved)
    train = load("trl-internal-testing/zen", "standard_preference", split="train")
    assert len(train) == 17 and train.column_names == ["prompt", "chosen", "rejected"]
    both = load("trl-internal-testing/zen", "standard_unpaired_preference")
    assert {k: len(v) for k, v in both.items()} == {"train": 17, "test": 2}
    stream = load("trl-internal-testing/zen", "standard_prompt_only", split="test", streaming=True)
    assert [row["prompt"] for row in stream] == list(load("trl-internal-testing/zen", "standard_prompt_only",
                                                          split="test")["prompt"])
    assert load("other/set", "x", split="train")[0] == "real"
    with pytest.raises(pytest.skip.Exception, match="no stand-in for the data set trl-internal-testing/toolcall"):
        load("trl-internal-testing/toolcall", "preference", split="train")


def test_tokenizer_and_model_builds_are_deterministic(tmp_path):
    assert standins.base_tokenizer().to_str() == standins.base_tokenizer().to_str()
    make = standins.model_specs()["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]
    states = []
    for _ in range(2):
        import torch

        torch.manual_seed(0)
        model, tok, _ = make()
        standins.init_tiny(model)
        states.append(model.state_dict())
    assert states[0].keys() == states[1].keys() and all(states[0][k].equal(states[1][k]) for k in states[0])
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                                add_generation_prompt=True)


def test_refusal_and_missing_standin_are_told_apart(tmp_path):
    from hl_core.errors import UserError

    (tmp_path / "standins.json").write_text(json.dumps({"models": ["trl-internal-testing/tiny-Qwen3ForCausalLM"]}))
    try:
        try:
            raise UserError("`loss_type='ipo'` cannot be combined with humanline: reason. Fix: do that.")
        except UserError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert isinstance(harness.refusal_in(outer), UserError)
        assert harness.missing_standin(outer, tmp_path) is None
    offline = OSError("We couldn't connect to load trl-internal-testing/tiny-GptOssForCausalLM. offline mode")
    assert harness.missing_standin(offline, tmp_path) == "trl-internal-testing/tiny-GptOssForCausalLM"
    known = OSError("couldn't connect for trl-internal-testing/tiny-Qwen3ForCausalLM")
    assert harness.missing_standin(known, tmp_path) is None  # built, so a real failure
    assert harness.refusal_in(TypeError("x")) is None
    assert harness.first_line(IndexError("index 1 is out of bounds\nmore")) == "IndexError: index 1 is out of bounds"


def _vendored_tests():
    found = set()
    for path in harness.VENDORED.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found |= {f"{path.name}::{node.name}::{f.name}" for f in node.body
                          if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    return found


def test_ci_list_names_real_tests_and_causes():
    listed = harness.read_ci_list()
    assert listed, "the CI subset is empty"
    known = _vendored_tests()
    for test, expected in listed.items():
        assert test.split("[", 1)[0] in known, test
        if expected.expect == "xfail":
            assert issubclass(expected.exception, BaseException)


def test_ci_list_is_read(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text("# comment\npass a.py::A::test_b  # note\nxfail a.py::A::test_c[x] IndexError: index 1 is out\n")
    listed = harness.read_ci_list(path)
    assert [(e.test, e.expect, e.cause) for e in listed.values()] == [
        ("a.py::A::test_b", "pass", ""), ("a.py::A::test_c[x]", "xfail", "IndexError: index 1 is out")]
    assert listed["a.py::A::test_c[x]"].exception is IndexError


@pytest.mark.parametrize("release, expect", [("1.14.0", "refusal"), ("1.16.0", "pass"), ("1.15.0rc1", "pass")])
def test_a_release_qualified_line_overrides_the_plain_one_on_its_releases(tmp_path, release, expect):
    path = tmp_path / "list.txt"
    path.write_text("refusal@<1.15 a.py::A::test_b\npass a.py::A::test_b\npass@<1.15 a.py::A::test_c\n")
    listed = harness.read_ci_list(path, trl_version=release)
    assert listed["a.py::A::test_b"].expect == expect
    assert ("a.py::A::test_c" in listed) == (release == "1.14.0")


def test_ci_list_rejects_a_bad_line(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text("# comment\npass test_dpo_trainer.py::A::test_b\nxfail test_kto_trainer.py::A::test_c\n")
    with pytest.raises(SystemExit, match=r"list.txt:3: .*xfail TEST CAUSE"):
        harness.read_ci_list(path)


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("HL_TRL_UPSTREAM", "ours")
    with pytest.raises(SystemExit, match="HL_TRL_UPSTREAM='ours' is not a mode"):
        harness.mode()


def test_vendored_files_are_not_collected_without_a_mode():
    env = {k: v for k, v in __import__("os").environ.items() if k != "HL_TRL_UPSTREAM"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "tests/trl_upstream"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "no tests collected" in proc.stdout, proc.stdout[-2000:]
