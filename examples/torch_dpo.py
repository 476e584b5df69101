"""Humanline DPO in a plain PyTorch loop: your model, your optimizer, your loop; humanline adds the per-token inputs,
a clip on the per-token log-ratios (or humanline sampling, ``--sample``) and a reference sync hooked onto the
optimizer. It stops and resumes exactly, its checkpoint read weights-only.

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
    SampleTransform,
    SyncSchedule,
    load_checkpoint_file,
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
    warmup = lambda n: min(1.0, (n + 1) / args.warmup)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)

    # humanline: clip (or sample) each token's log-ratio; sync the reference before every k-th step
    if args.sample:
        transform = SampleTransform(seed=args.seed)  # seeded: its draws resume exactly
    else:
        transform = ClipTransform(*args.clip)
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=args.sync_every))
    sync.attach(optimizer)

    start, saved = 0, Path(args.checkpoint or "none") / "state.pt"
    if saved.exists():  # resume: policy, optimizer, schedule, sync (count, reference), the draws
        state = load_checkpoint_file(saved)  # weights only: a crafted file is refused, nothing runs
        policy.load_state_dict(state["policy"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sync.load_state_dict(state["sync"])
        transform.load_state_dict(state["transform"])
        start = state["updates_done"]
    stop = min(args.steps, args.stop_after or args.steps)

    for update in range(start, stop):
        rows = pairs[update * args.batch:(update + 1) * args.batch]
        batch = collate_preference(rows, tokenizer.pad_token_id)
        ids, attention = batch["input_ids"], batch["attention_mask"]
        labels = ids.masked_fill(batch["completion_mask"] == 0, -100)  # -100: not scored
        logits = policy(input_ids=ids, attention_mask=attention).logits
        policy_logps = prefix_token_logps(logits, ids)
        with torch.no_grad():
            ref_logits = reference(input_ids=ids, attention_mask=attention).logits
            ref_logps = prefix_token_logps(ref_logits, ids)
        mask = mask_from_labels(labels)
        log_ratios, metrics = transform(policy_logps, ref_logps, mask)
        half = log_ratios.shape[0] // 2  # rows: the chosen completions, then the rejected ones
        margin = args.beta * (log_ratios[:half].sum(-1) - log_ratios[half:].sum(-1))
        loss = -F.logsigmoid(margin).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()  # the attached sync runs first, on every k-th update: pre-update weights
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        changed = 1 - metrics["unclamped_frac"].item()  # tokens the clip (or sampling) changed
        print(f"update {update}  loss {loss.item():.8f}  clipped {changed:.4f}  "
              f"synced {sync.last_record.synced}", flush=True)

    if args.checkpoint and stop < args.steps:  # stopped early: save what the resume above reads
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
        torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "sync": sync.state_dict(),
                    "transform": transform.state_dict(), "updates_done": stop}, saved)


if __name__ == "__main__":
    parser = example_parser(__doc__)
    parser.add_argument("--sample", action="store_true", help="humanline sampling instead of the clip")
    parser.set_defaults(nproc=1, clip=(-0.05, 0.05), sync_every=3, steps=10)  # bounds that bind once it moves
    args = parser.parse_args()
    launch(main, args, args.nproc)
