"""SFT (the reproduction study's warm-up): loss and gradients by hand, data errors, and a warm-up whose
final/ model starts an online GRPO run on the toy addition task."""

import math

import pytest
import torch

from helpers import REPO, read_jsonl, run_recipe
from hl_core.objectives.sft import sft_loss

WARMUP = REPO / "recipes" / "repro" / "warmup.yaml"


def test_sft_loss_and_gradient_by_hand():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=gen, dtype=torch.float64).requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    loss, metrics = sft_loss(lp, mask)
    picked = [float(lp.detach()[b, t]) for b in range(3) for t in range(5) if mask[b, t]]
    assert loss.item() == pytest.approx(-sum(picked) / len(picked), abs=1e-12)
    assert metrics["sft/ppl"] == pytest.approx(math.exp(loss.item()))
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, -mask / mask.sum())


@pytest.mark.parametrize(
    "row, needle",
    [('{"prompt": "1+1="}', "completion"), ('{"prompt": "1+1=", "completion": ""}', "empty"),
     ('{"completion": "2"}', "prompt"), ('[1]', "object")],
)
def test_sft_rows_errors(tmp_path, row, needle):
    from hl_core.data.sft import load_sft_records
    from hl_core.errors import DataError

    path = tmp_path / "d.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(DataError, match=needle) as info:
        load_sft_records(path=str(path))
    assert f"{path}:1" in str(info.value)


def test_sft_with_humanline_is_rejected():
    from hl_core.config import check_recipe, load_recipe
    from hl_core.errors import RecipeError

    with pytest.raises(RecipeError, match="sft"):
        check_recipe(load_recipe(WARMUP, ["humanline.sync_every=1"]))


def test_warmup_then_online_grpo_from_its_final_model(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    warm = tmp_path / "warm"
    run_recipe(WARMUP, [f"output_dir={warm}", "train.max_steps=25", "train.micro_batch_size=64"])
    rows = read_jsonl(warm / "metrics.jsonl")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, (rows[0]["loss"], rows[-1]["loss"])
    assert rows[0]["loss"] == pytest.approx(math.log(16), abs=0.5)  # ~uniform over the 16 tokens at init
    rl = tmp_path / "rl"
    run_recipe(REPO / "recipes" / "tiny" / "online_grpo_math.yaml", [
        f"output_dir={rl}", f"model.name_or_path={warm / 'final'}", "model.random_init=false",
        "data.train.path=tests/fixtures/toy_add/prompts_train.jsonl",
        "data.eval.path=tests/fixtures/toy_add/prompts_eval.jsonl",
        "data.chat_template=raw", "data.max_prompt_length=8", "rollout.max_new_tokens=4", "train.max_steps=2",
        "eval.every=2", "checkpoint.save_final=false",
    ])
    metrics = read_jsonl(rl / "metrics.jsonl")
    assert [m["rollout"] for m in metrics] == [True, True] and all(m["ratio/mean"] == 1.0 for m in metrics)
    assert all(0.0 <= e["reward"] <= 1.0 for e in read_jsonl(rl / "eval.jsonl"))
