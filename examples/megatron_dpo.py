"""Humanline DPO in a Megatron-core loop: your model chunks, your forward step, loss function and optimizer; humanline
adds a clip on the per-token log-ratios (or humanline sampling, ``--sample``) and a shard-local sync of each rank's
TP/PP slices before the step; its checkpoint is read weights-only.

    python examples/megatron_dpo.py                   # 2 CPU processes, tensor parallel 2, the tiny model and pairs
    torchrun --nproc_per_node 8 examples/megatron_dpo.py --tp 8 --model DIR --data pairs.jsonl   # on GPUs

Needs the `megatron` extra: `pip install -e ".[megatron]"` (without it the script says so and exits 2). On CPU
Megatron-core's notes about Transformer Engine, Apex and GPU-only settings are silenced: the CPU path uses neither.
"""

from _extras import require_extra

require_extra("megatron", "megatron.core")  # before the imports that need it: one paragraph and exit 2

import warnings
from pathlib import Path

# megatron-core warns on import, once per module and process, that Transformer Engine and Apex (optional GPU kernel
# packages) are absent and it uses torch's own implementations: expected on CPU, so filtered before the imports
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)

import torch
import torch.nn.functional as F
from _launch import launch, load_model, parser as example_parser
from megatron.core import parallel_state as ps, tensor_parallel
from transformers import AutoTokenizer

from hl_core.data import collate_preference, load_preference_records, tokenize_preference
from hl_core.humanline import (
    ClipTransform,
    ReferenceSync,
    SampleTransform,
    SyncSchedule,
    check_checkpoint_files,
    load_checkpoint_file,
    pair_parameters,
)
from hl_core.mcore import causal_mask, gpt_chunk_from_hf, use_cpu

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", module="megatron")  # its notes on GPU-only settings


def build_chunks(args, tp_rank):
    """Your model chunks (one here: pp = 1): this rank's TP slice of the HF weights (a bridge does the same)."""
    return [gpt_chunk_from_hf(load_model(args.model, args.seed), tp=args.tp, tp_rank=tp_rank)]


def forward_step(chunks, batch):
    """Per-token log-probs ``[2B, T]`` (0 at position 0) from vocab-parallel logits: no rank holds all of them."""
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    logits = chunks[0](ids, positions, causal_mask(ids.shape[1]))
    logps = -tensor_parallel.vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), ids[:, 1:])
    return F.pad(logps, (1, 0))


def clip_grad_norm_(params, max_norm):
    """The global gradient norm over the TP group (duplicates counted once), then clipping."""
    counted = [p for p in params if tensor_parallel.param_is_not_tensor_parallel_duplicate(p)]
    squares = sum(p.grad.pow(2).sum() for p in counted)
    torch.distributed.all_reduce(squares, group=ps.get_model_parallel_group())
    coef = max_norm / (squares.sqrt() + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)


def main(args):
    if not torch.cuda.is_available():
        use_cpu()  # megatron-core on CPU: the shims our engine uses (gloo, no CUDA kernels)
    torch.distributed.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    tp_rank, rank = ps.get_tensor_model_parallel_rank(), torch.distributed.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pairs = [tokenize_preference(r, tokenizer, args.max_length, args.max_prompt_length)
             for r in load_preference_records(path=args.data)]
    policy, reference = build_chunks(args, tp_rank), build_chunks(args, tp_rank)
    for chunk in reference:
        chunk.requires_grad_(False).eval()
    params = [p for chunk in policy for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, (n + 1) / args.warmup))

    # humanline: clip (or sample) each token's log-ratio; sync each rank's slices every k updates
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if args.sample:
        transform = SampleTransform(seed=args.seed + dp_rank)  # TP peers draw alike
    else:
        transform = ClipTransform(*args.clip)
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=args.sync_every))

    start, saved = 0, Path(args.checkpoint or "none") / f"rank{rank}.pt"
    if saved.exists():  # resume: this rank's chunks, optimizer, LR schedule, sync and draws
        check_checkpoint_files(saved.parent)  # every rank, every file: a bad one refused alike
        state = load_checkpoint_file(saved)  # weights only: a crafted file is refused
        for chunk, weights in zip(policy, state["policy"]):
            chunk.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sync.load_state_dict(state["sync"])
        transform.load_state_dict(state["transform"])
        start = state["updates_done"]
    stop, binding = min(args.steps, args.stop_after or args.steps), []

    for update in range(start, stop):
        first = (update * dp + dp_rank) * args.batch  # TP peers take the same pairs
        batch = collate_preference(pairs[first:first + args.batch], tokenizer.pad_token_id)
        mask = batch["completion_mask"].float()
        policy_logps = forward_step(policy, batch)
        with torch.no_grad():
            ref_logps = forward_step(reference, batch)
        log_ratios, metrics = transform(policy_logps, ref_logps, mask)
        half = log_ratios.shape[0] // 2
        margin = args.beta * (log_ratios[:half].sum(-1) - log_ratios[half:].sum(-1))
        loss = -F.logsigmoid(margin).mean()
        loss.backward()
        clip_grad_norm_(params, 1.0)
        synced = sync.before_optimizer_step(update).synced  # after backward, clipping; before step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if rank == 0:
            print(f"update {update}  loss {loss.item():.8f}  clipped {1 - metrics['unclamped_frac'].item():.4f}  "
                  f"synced {synced}", flush=True)
        binding += [update] if metrics["unclamped_frac"].item() < 1 else []
    if args.checkpoint and stop < args.steps:  # stopped early: what the resume above reads, one file per rank
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
        torch.save({"policy": [chunk.state_dict() for chunk in policy], "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "sync": sync.state_dict(),
                    "transform": transform.state_dict(), "updates_done": stop}, saved)
    if rank == 0:
        print(f"the clip bound at updates {binding} (bounds {tuple(args.clip)})", flush=True)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = example_parser(__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sample", action="store_true", help="humanline sampling instead of the clip")
    parser.set_defaults(clip=(-0.05, 0.05))  # bounds that bind once the policy moves (the paper's +-1.5 bind later)
    args = parser.parse_args()
    launch(main, args, args.nproc)
