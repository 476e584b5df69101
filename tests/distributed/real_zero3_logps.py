"""Run under torchrun (2 processes, gloo): the real SmolLM2-135M-Instruct (issue 46) under DeepSpeed ZeRO-3.

argv: REPORT MODEL_DIR. The pack's DeepSpeed engine is built from the real-model DPO recipe at ZeRO-3, full
fine-tuning (its weights loaded straight into ZeRO-3 partitions, each rank holding half of every parameter), and
computes the per-token log-probs of a collated batch of real conversations (both ranks the same batch, as ZeRO-3
gathers in lockstep). Rank 0 then loads the model plainly in this one process (no DeepSpeed) and computes the same
log-probs; the report holds both, the partition sizes and the largest difference.
"""

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hl_core.config import engine_spec, load_recipe  # noqa: E402
from hl_core.data import collate_preference, tokenize_preference  # noqa: E402
from hl_core.data.preference import parse_preference_row  # noqa: E402
from hl_core.engines.deepspeed_engine import DeepSpeedEngine  # noqa: E402
from hl_core.logprobs import sequence_token_logps  # noqa: E402
from hl_core.models.loading import load_tokenizer  # noqa: E402

report_path, model_dir = sys.argv[1], sys.argv[2]
recipe = load_recipe(REPO / "recipes/real/smollm2_humanline_dpo.yaml", [
    f"model.name_or_path={model_dir}", "model.lora=null", "engine.zero_stage=3", "train.micro_batch_size=2",
    "humanline.reference=copy",
])
tokenizer = load_tokenizer(recipe.model)


def conversation(prompt, answer):
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


rows = [{"chosen": conversation("What is the capital of France?", "The capital of France is Paris."),
         "rejected": conversation("What is the capital of France?", "Rome.")},
        {"chosen": conversation("What is 21 + 39?", "60"), "rejected": conversation("What is 21 + 39?", "61")}]
features = [tokenize_preference(parse_preference_row(r, f"t:{i}"), tokenizer, 64, 48) for i, r in enumerate(rows)]
batch = collate_preference(features, tokenizer.pad_token_id)

engine = DeepSpeedEngine(engine_spec(recipe), tokenizer)
first = next(engine.policy.module.parameters())
with torch.no_grad():
    zero3 = engine.token_logps(batch, "policy").float().cpu()
    zero3_reference = engine.token_logps(batch, "reference").float().cpu()
report = {"world": engine.world_size, "zero_stage": engine.zero_stage, "partition_numel": int(first.ds_tensor.numel()),
          "full_numel": int(first.ds_numel)}
engine.close(destroy_process_group=False)
if engine.rank == 0:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        single = sequence_token_logps(plain, batch["input_ids"], batch["attention_mask"]).float()
    valid = batch["attention_mask"].bool()
    valid[:, 0] = False  # position 0 has no log-prob (0 by the layout)
    report.update({
        "shape": list(single.shape), "zero3_shape": list(zero3.shape),
        "max_abs_diff": (zero3 - single)[valid].abs().max().item(),
        "reference_max_abs_diff": (zero3_reference - single)[valid].abs().max().item(),
        "logps_range": [single[valid].min().item(), single[valid].max().item()],
    })
    Path(report_path).write_text(json.dumps(report, indent=1))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
