"""The vLLM sampler's recipe side, without vLLM (the real engine's tests: tests/vllm_cpu, in their own environment):
every `rollout.vllm` key reaches the engine or the push, the supported version range is refused outside it, and
`rollout.backend: vllm` without vLLM is refused in one paragraph (exit 2) before anything is built."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import REPO
from hl_core.config import load_recipe, sampling
from hl_core.config.sections_run import VLLMRolloutConfig
from hl_core.errors import RecipeError
from hl_core.rollout.generation import prompt_seed
from hl_core.rollout.vllm_sampler import SUPPORTED_VLLM, check_vllm_version, llm_kwargs, request_seed

DIGITS = REPO / "recipes/tiny/online_grpo_digits.yaml"


def _sampling(*overrides):
    """What the sampler reads of the digits recipe (``hl_core.config.sampling``)."""
    return sampling(load_recipe(DIGITS, ["rollout.backend=vllm", *overrides]))


def test_every_vllm_key_reaches_the_engine():
    default = llm_kwargs(_sampling(), 1, on_gpu=False)
    assert default["dtype"] == "float32" and default["enforce_eager"] is True and "max_model_len" not in default
    assert default["load_format"] == "dummy" and "distributed_executor_backend" not in default  # random init, 1 rank
    assert default["kv_cache_memory_bytes"] == 8 * 2**30 and default["enable_prefix_caching"] is True
    changed = llm_kwargs(_sampling("rollout.vllm.kv_cache_memory_gb=0.5", "rollout.vllm.kv_cache_dtype=fp8",
                                 "rollout.vllm.dtype=bfloat16", "rollout.vllm.max_model_len=300",
                                 "rollout.vllm.enforce_eager=false", "model.random_init=false"), 2, on_gpu=False)
    assert changed["kv_cache_memory_bytes"] == 2**29 and changed["kv_cache_dtype"] == "fp8"
    assert changed["dtype"] == "bfloat16" and changed["max_model_len"] == 300 and changed["enforce_eager"] is False
    assert "load_format" not in changed and changed["distributed_executor_backend"] == "external_launcher"
    assert llm_kwargs(_sampling("engine.precision=bf16"), 1, on_gpu=True)["dtype"] == "bfloat16"
    assert llm_kwargs(_sampling(), 1, on_gpu=True)["enforce_eager"] is False  # CUDA graphs on a GPU
    # bucket_mb is read by the push (VLLMSampler.bucket_bytes; its effect: tests/vllm_cpu's ZeRO-3 bucket test);
    # dtype's `auto` is resolved with the training precision (hl_core.config.sampling)
    source = "".join((REPO / path).read_text() for path in ("hl_core/rollout/vllm_sampler.py",
                                                           "hl_core/config/decisions.py"))
    for key in VLLMRolloutConfig.model_fields:
        assert f"vcfg.{key}" in source or f"vllm.{key}" in source, f"rollout.vllm.{key} is read nowhere"


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_versions_outside_the_range_are_refused(version):
    with pytest.raises(RecipeError) as err:
        check_vllm_version(version)
    message = str(err.value)
    assert f"vLLM {version}" in message and "rollout.backend=hf" in message and "\n" not in message
    assert f">= {SUPPORTED_VLLM[0]}, < {SUPPORTED_VLLM[1]}" in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.4", "0.32.1+cpu", "0.32.0rc1.dev5"])
def test_versions_inside_the_range_pass(version):
    check_vllm_version(version)


def test_request_seeds_of_neighbouring_prompts_do_not_overlap():
    """vLLM seeds a request's n samples seed, seed + 1, ...: neighbouring prompts must not share those streams."""
    seeds = [request_seed(prompt_seed(0, p)) for p in range(2048)]
    assert len(seeds) == len(set(seeds)) and all(0 <= s < 2**62 for s in seeds)
    spans = sorted(seeds)
    assert min(b - a for a, b in zip(spans, spans[1:])) > 64  # n up to 64 samples per prompt stay apart
    assert request_seed(prompt_seed(0, 5)) == request_seed(prompt_seed(0, 5))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this environment")
def test_vllm_backend_without_vllm_is_refused_before_anything_is_built(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "launchers/run.py"), str(DIGITS), "rollout.backend=vllm",
         f"output_dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "`rollout.backend: vllm`" in proc.stderr
    assert "rollout.backend=hf" in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
