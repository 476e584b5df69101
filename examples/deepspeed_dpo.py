"""Humanline DPO in a plain DeepSpeed loop: you call ``deepspeed.initialize``; humanline adds a clip on the per-token
log-ratios (or humanline sampling, ``--sample``), a shard-local reference sync between backward and ``engine.step()``,
and weights-only checkpoint loads (DeepSpeed's own checkpoint engine unpickles).

    python examples/deepspeed_dpo.py                    # 2 CPU processes, ZeRO-3, the tiny model and pairs
    deepspeed --num_gpus 8 examples/deepspeed_dpo.py --model meta-llama/Meta-Llama-3-8B-Instruct --data pairs.jsonl

Needs only the base install: `pip install -e .` (DeepSpeed is part of it). On CPU it compiles nothing (see
``no_shm_compile`` in ``_launch.py``).
"""

import warnings
from pathlib import Path

import deepspeed
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
    pair_parameters,
    weights_only_checkpoints,
)

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on DeepSpeed's calls


def token_logps(model, batch):
    """``[2B, T]`` log-probs of each token given its prefix (0 at position 0), aligned with ``input_ids``."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
    logps = logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(logps, (1, 0))


def main(args):
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    records = load_preference_records(path=args.data)
    pairs = [tokenize_preference(r, tokenizer, args.max_length, args.max_prompt_length) for r in records]
    zero = {"stage": args.zero, "stage3_param_persistence_threshold": args.persist_below}
    config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": zero,
              "gradient_clipping": 1.0}
    policy = load_model(args.model, args.seed)
    reference = load_model(args.model, args.seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    warmup = lambda n: min(1.0, (n + 1) / args.warmup)  # noqa: E731
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup)  # noqa: E731
    policy, _, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config,
                                           lr_scheduler=schedule)
    weights_only_checkpoints(policy)  # load_checkpoint: weights only, a crafted file runs nothing
    # the reference: an engine without an optimizer, partitioned like the policy at ZeRO-3
    ref_config = config if args.zero == 3 else {**config, "zero_optimization": {"stage": 0}}
    reference, _, _, _ = deepspeed.initialize(model=reference.requires_grad_(False), config=ref_config)
    reference.eval()

    # humanline: clip (or sample) each token's log-ratio; sync the reference every k updates
    if args.sample:
        transform = SampleTransform(seed=args.seed + rank)  # each data-parallel rank its own draws
    else:
        transform = ClipTransform(*args.clip)
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=args.sync_every))

    start, saved = 0, Path(args.checkpoint or "none") / "resume"
    if saved.is_dir():  # resume: the engine's checkpoint, then this rank's sync and transform states
        _, client_state = policy.load_checkpoint(args.checkpoint, tag="resume")
        state = load_checkpoint_file(saved / f"humanline_rank{rank}.pt")
        sync.load_state_dict(state["sync"])
        transform.load_state_dict(state["transform"])
        start = client_state["updates_done"]
    stop, binding = min(args.steps, args.stop_after or args.steps), []

    for update in range(start, stop):
        first = (update * world + rank) * args.batch  # this rank's pairs of this update, in file order
        batch = collate_preference(pairs[first:first + args.batch], tokenizer.pad_token_id)
        mask = batch["completion_mask"].float()
        policy_logps = token_logps(policy, batch)
        with torch.no_grad():
            ref_logps = token_logps(reference, batch)
        log_ratios, metrics = transform(policy_logps, ref_logps, mask)
        half = log_ratios.shape[0] // 2
        margin = args.beta * (log_ratios[:half].sum(-1) - log_ratios[half:].sum(-1))
        loss = -F.logsigmoid(margin).mean()
        policy.backward(loss)
        synced = sync.before_optimizer_step(update).synced  # after backward, before step: theta_n
        policy.step()
        shown = torch.stack([loss.detach(), 1 - metrics["unclamped_frac"].float()])
        torch.distributed.all_reduce(shown)
        if rank == 0:
            print(f"update {update}  loss {shown[0].item() / world:.8f}  "
                  f"clipped {shown[1].item() / world:.4f}  synced {synced}", flush=True)
        binding += [update] if shown[1].item() > 0 else []
    if args.checkpoint and stop < args.steps:  # stopped early: what the resume above reads
        policy.save_checkpoint(args.checkpoint, tag="resume", client_state={"updates_done": stop})
        state = {"sync": sync.state_dict(), "transform": transform.state_dict()}
        torch.save(state, saved / f"humanline_rank{rank}.pt")
    if rank == 0:
        print(f"the clip bound at updates {binding} (bounds {tuple(args.clip)})", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    parser = example_parser(__doc__)
    parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--persist-below", type=int, default=1000, help="ZeRO-3: smaller parameters stay whole")
    parser.add_argument("--sample", action="store_true", help="humanline sampling instead of the clip")
    parser.set_defaults(clip=(-0.05, 0.05))  # bounds that bind once the policy moves (the paper's +-1.5 bind later)
    args = parser.parse_args()
    launch(main, args, args.nproc)
