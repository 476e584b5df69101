"""The megatron-core engine on CPU (gloo, 2 processes): parity with Hugging Face models, shard-local
humanline syncing, identical humanline DPO runs at tp=1, tp=2 and pp=2 (fp32, dropout 0), and the pp=2
backward recomputing with the same dropout masks."""

import json

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tests: they exercise the gloo path and the CPU shim, which is never installed on a GPU"
)

from helpers import REPO, read_jsonl, run_recipe, run_torchrun  # noqa: E402

TINY_MEGATRON_TP2 = REPO / "recipes/tiny/megatron_humanline_dpo.yaml"
TINY_MEGATRON_PP2 = REPO / "recipes/tiny/megatron_tp1_pp2_humanline_dpo.yaml"
# short runs that move the weights visibly; sync every 2nd update so both branches of the sync are seen;
# two micro-batches per update (accumulation) and a clip norm below the gradient norms (clipping active)
RUN = ["train.max_steps=4", "train.lr=5e-3", "train.micro_batch_size=4", "train.gradient_accumulation_steps=2",
       "train.max_grad_norm=0.5", "eval.every=null", "checkpoint.save_every=null", "checkpoint.resume=never"]


def test_models_match_hugging_face_for_every_family_and_layout(tmp_path):
    report = tmp_path / "parity.json"
    run_torchrun(REPO / "tests/distributed/megatron_parity.py", [report], nproc=2)
    rows = json.loads(report.read_text())
    assert {(r["family"], r["tp"], r["pp"]) for r in rows} == {
        (f, tp, pp) for f in ("llama", "qwen2", "gemma2") for tp, pp in ((1, 1), (2, 1), (1, 2))
    }
    for r in rows:
        if r["pp"] == 1:
            assert r["logits_diff"] < 1e-4, r
            assert r["local_vocab"] == 96 // r["tp"], "TP logits stay vocab-parallel"
        assert r["logps_diff"] < 1e-4, r
        assert r["logps_same_on_all_ranks"], r
        assert r["grad_names_match"] and r["grad_diff"] < 1e-4 * max(1.0, r["grad_scale"]), r
        assert r["weights_roundtrip_exact"], r
    gemma = next(r for r in rows if r["family"] == "gemma2" and r["tp"] == 1 and r["pp"] == 1)
    # the Gemma 2 features are live in the comparison: without them the logits are far off
    assert gemma["no_window_diff"] > 1e-2 and gemma["no_softcap_diff"] > 1e-2, gemma


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    """The reference: the same recipe at tp=1 in one process (same data per update as tp=2 / pp=2)."""
    out = tmp_path_factory.mktemp("tp1")
    run_recipe(TINY_MEGATRON_TP2, ["parallel.tp=1", "humanline.sync_every=2", f"output_dir={out}", *RUN], nproc=1)
    return out


def _losses(rows):
    return [r["loss"] for r in rows if r.get("kind") != "eval"]


def _assert_same_run(rows, reference):
    """Per-update losses and (pre-clip) gradient norms equal to the tp=1 run's."""
    rows, reference = [r for r in rows if r.get("kind") != "eval"], [r for r in reference if r.get("kind") != "eval"]
    assert len(rows) == len(reference) == 4
    for key in ("loss", "grad_norm"):
        a, b = [r[key] for r in rows], [r[key] for r in reference]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (key, a, b)
    assert all(r["grad_norm"] > 0.5 for r in reference), "clipping was active"


def _hf_checkpoint_of_the_random_init(directory):
    """The tiny recipe's random-init model (train.seed) saved as a Hugging Face checkpoint."""
    from hl_core.config import load_recipe
    from hl_core.models.loading import build_causal_lm, load_tokenizer

    recipe = load_recipe(TINY_MEGATRON_TP2)
    build_causal_lm(recipe.model, "fp32", recipe.train.seed).save_pretrained(directory)
    load_tokenizer(recipe.model).save_pretrained(directory)
    return directory


def test_tp2_sync_is_shard_local_and_losses_match_tp1(tmp_path, tp1_run):
    """tp=2, starting from a Hugging Face checkpoint on disk (each rank reads its own slices)."""
    report = tmp_path / "report.json"
    out = tmp_path / "run"
    init = _hf_checkpoint_of_the_random_init(tmp_path / "init")
    run_torchrun(REPO / "tests/distributed/megatron_sync.py",
                 [report, out, TINY_MEGATRON_TP2, 2, *RUN, f"model.name_or_path={init}", "model.random_init=false"],
                 nproc=2)
    data = json.loads(report.read_text())
    assert (data["tp"], data["pp"]) == (2, 1)
    assert data["probe_calls"] > 0, "the collective counter sees a gather"
    records = data["records"]
    assert [r["n"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r["synced"] == (r["n"] % 2 == 0)
        assert r["policy_moved"] > 1e-4, "the optimizer step changed the policy"
        if r["synced"]:
            assert r["ref_vs_pre_policy"] == 0.0, r  # the reference holds theta_n exactly
            assert r["sync_collectives"] == 0, "sync must not gather or communicate"
        else:
            assert r["ref_vs_pre_ref"] == 0.0, "reference unchanged between syncs"
    _assert_same_run(data["metrics"], read_jsonl(tp1_run / "metrics.jsonl"))
    tp1 = _losses(read_jsonl(tp1_run / "metrics.jsonl"))
    assert abs(tp1[0] - 0.6931471805599453) < 1e-6 and tp1[-1] != tp1[0]
    # final/: merged from the TP shards, loadable, equal to the tp=1 run's weights
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tp1_run / "final").state_dict()
    assert set(a) == set(b) and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_tp2_soft_update_mixes_each_shard(tmp_path):
    """`humanline.sync_mix: 0.5` at tp=2: every sync leaves the gathered reference at `lerp(reference, pre-update
    policy, 0.5)`, each rank mixing its own slices, with no collective."""
    report = tmp_path / "report.json"
    run_torchrun(REPO / "tests/distributed/megatron_sync.py",
                 [report, tmp_path / "run", TINY_MEGATRON_TP2, 1, *RUN, "train.max_steps=3", "humanline.sync_mix=0.5",
                  "checkpoint.save_final=false"], nproc=2)
    data = json.loads(report.read_text())
    records = data["records"]
    assert (data["tp"], data["pp"]) == (2, 1) and [r["n"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["synced"] and r["sync_collectives"] == 0 and r["ref_vs_mix"] <= 1e-6, r
    for r in records[1:]:  # neither the policy nor the old reference: the mixture
        assert r["ref_vs_pre_policy"] > 1e-4 and r["ref_vs_pre_ref"] > 1e-4, r


def test_pp2_run_resumes_and_matches_tp1(tmp_path, tp1_run):
    """pp=2 with activation recompute (model.gradient_checkpointing), stopped after 2 updates and resumed."""
    out = tmp_path / "run"
    common = ["humanline.sync_every=2", f"output_dir={out}", "model.gradient_checkpointing=true", *RUN[:-1]]
    run_recipe(TINY_MEGATRON_PP2, [*common, "checkpoint.resume=never", "train.stop_after=2"], nproc=2)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert not (out / "final").exists()
    run_recipe(TINY_MEGATRON_PP2, [*common, "checkpoint.resume=auto"], nproc=2)
    _assert_same_run(read_jsonl(out / "metrics.jsonl"), read_jsonl(tp1_run / "metrics.jsonl"))
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tp1_run / "final").state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_pp2_backward_recomputes_with_the_same_dropout_masks(tmp_path):
    report = tmp_path / "dropout.json"
    run_torchrun(REPO / "tests/distributed/megatron_dropout.py", [report, tmp_path / "run"], nproc=2)
    data = json.loads(report.read_text())
    assert all(u["pieces"] == 4 for u in data["updates"]), "16 rows in 4 pipeline micro-batches"
    assert data["updates"][0]["policy_vs_reference"] > 1e-3, "dropout is active in the policy (step 0: same weights)"
    assert all(u["recompute_diff"] == 0.0 for u in data["updates"]), data
    assert data["control"]["recompute_diff"] > 1e-3, "without the RNG restore the masks differ"


def test_sdpa_core_attention_equals_megatron_dot_product_attention(tmp_path):
    """The fused attention swapped into the local layer spec (no Transformer Engine) computes what
    megatron-core's own DotProductAttention computes: forward and q/k/v gradients, GQA, tp=2."""
    report = tmp_path / "attention.json"
    run_torchrun(REPO / "tests/distributed/megatron_attention.py", [report], nproc=2)
    r = json.loads(report.read_text())
    assert r["shape"] == [24, 3, 4 * 16]  # [s, b, local heads x head dim]
    assert r["output_scale"] > 0.1
    assert r["forward_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r
