"""With `train.fused_logprobs`, no forward of an update or an evaluation holds `[B, T, V]` logits (issue 40): for DPO,
KTO and GRPO and every reference mode (a copy, the look-ahead store, the cached frozen reference) through the real
trainer on the DeepSpeed engine. Every tensor an operation creates is watched (``LargestVocabTensor``); the largest
one whose last dimension is the vocabulary must fit one block of ``train.logps_chunk_tokens`` tokens. The control:
the logits path does hold them (so the watch can fail)."""

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hl_core.config import load_recipe
from hl_core.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
BLOCK = 8  # train.logps_chunk_tokens: far fewer than a micro-batch's tokens


class LargestVocabTensor(TorchDispatchMode):
    """The largest number of rows (elements / vocabulary) of any tensor an operation allocates whose last dimension is
    the vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # new storages only (a view such as the weight's transpose holds nothing new)
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and t.untyped_storage().data_ptr() not in inputs):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


MODES = {
    "copy": ["humanline.reference=copy"],
    "lookahead": ["humanline.reference=lookahead"],
    "cached": ["humanline.sync_every=null", "train.cache_reference_logps=true"],
}


def _rows_held(tmp_path, recipe: str, mode: str, fused: bool) -> tuple:
    recipe = load_recipe(REPO / "recipes" / "tiny" / recipe, [
        f"output_dir={tmp_path / 'run'}", "train.max_steps=1", "eval.every=1", "checkpoint.save_every=null",
        "checkpoint.save_final=false", "logging.progress_bar=false", "train.micro_batch_size=2",
        f"train.fused_logprobs={str(fused).lower()}", f"train.logps_chunk_tokens={BLOCK}", "eval.max_batches=1",
        *MODES[mode],
    ])
    trainer = Trainer(recipe)
    trainer.setup()
    try:
        assert trainer.reference.mode == mode
        vocab = trainer.engine.policy.module.get_output_embeddings().weight.shape[0]
        watch = LargestVocabTensor(vocab)
        with watch:
            trainer.train_step()
            if trainer.eval_data is not None:
                trainer._evaluate()
        tokens = int(trainer.source.batches(trainer.updates_done)[0]["attention_mask"].numel())
        return watch.rows, tokens
    finally:
        trainer.close()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("recipe", ["humanline_dpo.yaml", "humanline_kto.yaml", "humanline_grpo.yaml"])
def test_no_forward_holds_the_logits_with_fused_logprobs(tmp_path, recipe, mode):
    rows, tokens = _rows_held(tmp_path, recipe, mode, fused=True)
    assert 0 < rows <= BLOCK < tokens, (recipe, mode, rows, tokens)


def test_the_logits_path_holds_them(tmp_path):
    rows, tokens = _rows_held(tmp_path, "humanline_dpo.yaml", "copy", fused=False)
    assert rows >= tokens // 2, (rows, tokens)
