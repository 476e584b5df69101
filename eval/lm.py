"""Generation backends for the evals, all as lm-eval ``LM`` objects.

* ``hf``: lm-eval's ``HFLM`` (Hugging Face ``generate``; runs on CPU).
* ``vllm``: lm-eval's ``VLLM`` (needs the ``vllm`` package and a GPU).
* ``auto``: ``vllm`` when it is importable and CUDA is available, else ``hf``.
* `ScriptedLM` (registered in lm-eval as ``hl_scripted``): a model-free generator whose replies
  come from a Python function; the tests use it as a planted "model" to check the scoring end to end.

`generate` runs any of them on plain prompts (AlpacaEval generation uses it), so MATH500 and
AlpacaEval share one backend layer.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ._common import EvalError, check_finite_weights, check_model_dir

log = logging.getLogger(__name__)

BACKENDS = ("auto", "hf", "vllm")
SCRIPTED_NAME = "hl_scripted"


def vllm_available() -> bool:
    try:
        import importlib.util

        import torch

        return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
    except Exception:
        return False


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise EvalError(f"backend `{backend}` is not known; use one of {', '.join(BACKENDS)}.")
    if backend == "auto":
        return "vllm" if vllm_available() else "hf"
    if backend == "vllm" and not vllm_available():
        raise EvalError(
            "backend `vllm` needs the `vllm` package and a CUDA GPU, and one of them is missing here. "
            "Fix: `pip install vllm` on a GPU machine, or use `--backend hf` (CPU or GPU)."
        )
    return backend


def make_lm(
    model: Union[str, Any],
    backend: str = "auto",
    *,
    batch_size: Union[int, str] = 1,
    dtype: str = "auto",
    device: Optional[str] = None,
    max_length: Optional[int] = None,
    trust_remote_code: bool = False,
    seed: int = 0,
    backend_kwargs: Optional[Dict[str, Any]] = None,
):
    """An lm-eval ``LM`` for ``model`` (a local HF model directory or a hub name).

    ``model`` may also already be an ``lm_eval.api.model.LM`` (returned as is). ``backend_kwargs`` go to
    the backend's constructor (e.g. ``tensor_parallel_size``, ``gpu_memory_utilization`` for vLLM).
    """
    from lm_eval.api.model import LM

    if isinstance(model, LM):
        return model
    backend = resolve_backend(backend)
    extra = dict(backend_kwargs or {})
    if isinstance(model, str) and not os.path.isdir(model) and _offline():
        raise EvalError(
            f"model `{model}` is not a local directory and hub access is off (offline mode). Fix: pass the path "
            f"of a Hugging Face model directory (e.g. RUN/final)."
        )
    check_model_dir(model)
    if backend == "hf":
        import torch
        from lm_eval.models.huggingface import HFLM

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        lm = HFLM(
            pretrained=model,
            device=device,
            batch_size=batch_size,
            dtype=dtype,
            max_length=max_length,
            trust_remote_code=trust_remote_code,
            **extra,
        )
        _no_hub_model_info(lm, model)
        check_finite_weights(lm.model, model)
        return lm
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM(
        pretrained=model,
        dtype=dtype,
        batch_size=batch_size,
        max_length=max_length,
        trust_remote_code=trust_remote_code,
        seed=seed,
        **extra,
    )


def _offline() -> bool:
    from ._common import is_offline

    return is_offline()


def _no_hub_model_info(lm, model) -> None:
    """HFLM.get_model_info asks the hub for the model's commit sha; skip that for local directories."""
    if not (isinstance(model, str) and os.path.isdir(model)):
        return
    original = lm.get_model_info

    def get_model_info() -> dict:
        import lm_eval.models.huggingface as hf_mod

        saved = hf_mod.HfApi
        hf_mod.HfApi = _NoHubApi
        try:
            return original()
        finally:
            hf_mod.HfApi = saved

    lm.get_model_info = get_model_info


class _NoHubApi:
    def model_info(self, *args, **kwargs):
        raise RuntimeError("local model directory: no hub lookup")


def has_chat_template(lm) -> bool:
    """Whether ``lm`` can render chat messages (a tokenizer chat template, or a scripted renderer)."""
    if isinstance(lm, ScriptedLM):
        return True
    tok = getattr(lm, "tokenizer", None)
    return bool(getattr(tok, "chat_template", None))


def render_chat(lm, messages: List[Dict[str, str]]) -> str:
    """``messages`` rendered with the model's chat template, ending with the assistant generation prompt."""
    return lm.apply_chat_template(messages, add_generation_prompt=True)


def check_generation_room(lm, max_new_tokens: int, key: str) -> None:
    """Refuse, before generating anything, ``max_new_tokens`` (set by ``key``) that leave no room for a prompt in
    the model's context (lm-eval's ``max_length``): lm-eval would stop at its first batch with an assertion."""
    context = getattr(lm, "max_length", None)
    if isinstance(context, int) and int(max_new_tokens) >= context:
        raise EvalError(
            f"{key} is {int(max_new_tokens)}, but the model's context holds {context} tokens, prompt included: nothing "
            f"would be left for the prompt. Fix: set {key} below {context} (e.g. {max(1, context // 2)})."
        )


def generate(lm, contexts: Sequence[str], gen_kwargs: Dict[str, Any]) -> List[str]:
    """``lm.generate_until`` on plain contexts (already chat-rendered when wanted), in order."""
    from lm_eval.api.instance import Instance

    requests = [
        Instance(request_type="generate_until", doc={}, arguments=(ctx, dict(gen_kwargs)), idx=0)
        for ctx in contexts
    ]
    try:
        return list(lm.generate_until(requests, disable_tqdm=True))
    except TypeError:
        return list(lm.generate_until(requests))


# --------------------------------------------------------------------------------------------- scripted


def _scripted_base():
    from lm_eval.api.model import LM

    return LM


class ScriptedLM(_scripted_base()):
    """A model-free lm-eval ``LM``: ``responder(context, gen_kwargs, k) -> str`` makes each reply.

    ``k`` is how many times this exact context was seen before (0 for the first sample of a problem,
    1 for the second, ...), so a script can answer the n samples of one problem differently. Chat
    messages are rendered as ``<|role|>\\ncontent\\n`` blocks followed by ``<|assistant|>\\n``.
    ``calls`` records every ``(context, gen_kwargs)`` received.
    """

    def __init__(self, responder: Optional[Callable[[str, dict, int], str]] = None, **kwargs):
        super().__init__()
        self.responder = responder or (lambda context, gen_kwargs, k: "")
        self.calls: List[tuple] = []
        self._seen: Dict[str, int] = defaultdict(int)

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            k = self._seen[context]
            self._seen[context] += 1
            self.calls.append((context, dict(gen_kwargs)))
            text = str(self.responder(context, gen_kwargs, k))
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("ScriptedLM only generates text")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("ScriptedLM only generates text")

    @property
    def tokenizer_name(self) -> str:
        return SCRIPTED_NAME

    def chat_template(self, chat_template: Union[bool, str] = False) -> str:
        return "<|role|>\\ncontent\\n"

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in chat_history)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def get_model_info(self) -> dict:
        return {"model": SCRIPTED_NAME}


def register_scripted() -> None:
    """Register `ScriptedLM` in lm-eval's model registry as ``hl_scripted`` (idempotent)."""
    from lm_eval.api.registry import register_model

    try:
        register_model(SCRIPTED_NAME)(ScriptedLM)
    except (ValueError, AssertionError, KeyError) as exc:  # already registered (e.g. module reloaded)
        log.debug("hl_scripted already registered: %s", exc)


register_scripted()
