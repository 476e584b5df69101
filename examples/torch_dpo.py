"""Humanline DPO in a plain PyTorch loop: your model, your optimizer, your loop; humanline adds the per-token inputs,
a clip on the per-token log-ratios and a reference sync hooked onto the optimizer. It stops and resumes exactly.

    python examples/torch_dpo.py                                  # one CPU process, the tiny model and pairs
    python examples/torch_dpo.py --stop-after 4 --checkpoint ckpt   # 4 updates, saved to ckpt/
    python examples/torch_dpo.py --checkpoint ckpt                  # the rest, from ckpt/

Needs only the base install: `pip install -e .`.
"""

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from _launch import launch, load_model, parser as example_parser
from transformers import AutoTokenizer

from hl_core.data import collate_preference, load_preference_records, tokenize_preference
from hl_core.humanline import (
    ClipTransform,
    ReferenceSync,
    SyncSchedule,
    mask_from_labels,
    pair_parameters,
    prefix_token_logps,
)

warnings.filterwarnings("ignore", category=FutureWarning)


def main(args):
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pairs = [tokenize_preference(r, tokenizer, args.max_length, args.max_prompt_length)
             for r in load_preference_records(path=args.data)]
    policy = load_model(args.model, args.seed)
    reference = load_model(args.model, args.seed).requires_grad_(False).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, (n + 1) / args.warmup))

    # humanline: clip each token's log-ratio, and sync the reference before every k-th optimizer step
    clip = ClipTransform(*args.clip)
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=args.sync_every))
    sync.attach(optimizer)

    start, saved = 0, Path(args.checkpoint or "none") / "state.pt"
    if saved.exists():  # resume: the policy, its optimizer and schedule, and the sync (its count, the reference)
        state = torch.load(saved, weights_only=True)
        policy.load_state_dict(state["policy"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sync.load_state_dict(state["sync"])
        start = state["updates_done"]
    stop = min(args.steps, args.stop_after or args.steps)

    for update in range(start, stop):
        batch = collate_preference(pairs[update * args.batch:(update + 1) * args.batch], tokenizer.pad_token_id)
        ids, attention = batch["input_ids"], batch["attention_mask"]
        labels = ids.masked_fill(batch["completion_mask"] == 0, -100)  # Hugging Face style: -100 = not scored
        policy_logps = prefix_token_logps(policy(input_ids=ids, attention_mask=attention).logits, ids)
        with torch.no_grad():
            ref_logps = prefix_token_logps(reference(input_ids=ids, attention_mask=attention).logits, ids)
        mask = mask_from_labels(labels)
        log_ratios, metrics = clip(policy_logps, ref_logps, mask)
        half = log_ratios.shape[0] // 2  # rows: the chosen completions, then the rejected ones
        loss = -F.logsigmoid(args.beta * (log_ratios[:half].sum(-1) - log_ratios[half:].sum(-1))).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()  # the attached sync runs first, on every k-th update: the pre-update weights
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        print(f"update {update}  loss {loss.item():.8f}  clipped {1 - metrics['unclamped_frac'].item():.4f}  "
              f"synced {sync.last_record.synced}", flush=True)

    if args.checkpoint and stop < args.steps:  # stopped early: save what the resume above reads
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
        torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "sync": sync.state_dict(), "updates_done": stop}, saved)


if __name__ == "__main__":
    parser = example_parser(__doc__)
    parser.set_defaults(nproc=1, clip=(-0.05, 0.05), sync_every=3, steps=10)  # bounds that bind once the policy moves
    args = parser.parse_args()
    launch(main, args, args.nproc)
