"""The one training loop. Reads top to bottom: setup, train, evaluate, save.

Per optimizer update ``n`` (``n`` = updates already done):

    micro-batches: fixed or by token budget, each weighted by its share of the update (hl_core.micro_batches)
    for each micro-batch:  policy/reference token log-probs -> humanline transform -> objective -> backward
    humanline sync (n % k == 0), after the last backward and before the optimizer step
    optimizer step (gradient clipping inside), metrics, periodic eval and checkpoint

It knows nothing of DeepSpeed or Megatron internals: everything goes through ``hl_core.engines.Engine``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import checkpoint_files as ckpt
from .config import Recipe, check_recipe, recipe_to_yaml
from .engines import build_engine
from .humanline import SyncRecord, build_transform
from .micro_batches import UpdateNormaliser, finish_metrics
from .reference_logps import build_reference_logps
from .objectives import OBJECTIVES, ObjectiveInputs, needs_old_logps
from .run_guard import (EXIT_INTERRUPTED, SLOW_UPDATES_ENV, GuardFlags, SkipCounter, StopSignals, first_nonfinite,
                        pause_for_test)
from .sinks import Sinks
from .trainer_safety import TrainerSafety

STOP_FILE = "STOP"  # created by a launcher (e.g. the SLURM time-limit trap): checkpoint and exit cleanly

# held-out metrics the end-of-run summary prints (start -> end), when the objective reports them
SUMMARY_EVAL_KEYS = {
    "policy/accuracy": "preference accuracy (policy log-prob of chosen > rejected)",
    "policy/margin": "per-token log-prob margin, preferred minus dispreferred",
    "policy/adv_logp": "advantage-weighted per-token log-prob",
    "reward": "mean reward of one sampled completion per prompt",
    "win_rate_vs_start": "win rate of that completion against the first evaluation's, under the reward",
    "rewards/accuracy": "reward accuracy against the current reference",
    "loss": "loss against the current reference",
}


class DataOrder:
    """Position in the endless data stream -> example index: epoch ``e`` is a permutation seeded by
    ``seed + e`` (or the identity without shuffling). Positions are global over ranks and updates, so a
    resumed run continues exactly where it stopped."""

    def __init__(self, num_examples: int, seed: int, shuffle: bool):
        self.num_examples, self.seed, self.shuffle = num_examples, seed, shuffle
        self._epoch, self._perm = -1, None

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_examples)
        if epoch != self._epoch:
            self._epoch = epoch
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.num_examples, generator=gen).tolist()
            else:
                self._perm = list(range(self.num_examples))
        return self._perm[offset]


class OfflineSource:
    """Micro-batches from the (tokenized) offline data set, in the seeded data order: the rank's units of the
    update, fixed or by token budget (``hl_core.micro_batches``)."""

    METRIC_KEYS = ()  # before_step reports nothing

    def __init__(self, engine, micro_batch_size: int, dataset, order: DataOrder, budget: Optional[int] = None):
        from .micro_batches import check_budget_fits

        self.engine, self.micro, self.dataset, self.order = engine, micro_batch_size, dataset, order
        self.budget = budget
        check_budget_fits(budget, dataset, "example")

    def before_step(self, step: int) -> Dict[str, float]:
        return {}

    def batches(self, step: int) -> List[dict]:
        from .data.build import takes_donors
        from .micro_batches import update_batches

        engine = self.engine
        own = [p for m in range(engine.gradient_accumulation_steps)
               for p in engine.micro_batch_positions(step, m, self.micro)]
        others = []
        if takes_donors(self.dataset.collate):
            # the update's other examples (all ranks): KTO pairs a prompt with another prompt's completion
            per_update = engine.gradient_accumulation_steps * engine.dp_size * self.micro
            mine = set(own)
            others = [self.dataset[self.order(p)] for p in range(step * per_update, (step + 1) * per_update)
                      if p not in mine]
        features = [self.dataset[self.order(p)] for p in own]
        return update_batches(self.dataset.collate, features, engine, self.micro, self.budget, others)


@dataclass
class _Accumulator:
    """Weighted mean of metrics over micro-batches and ranks, per key: a key that only some
    micro-batches report (e.g. KTO's reward of a kind absent from a batch) averages over those, and a
    key no micro-batch of any rank reported is left out. ``keys`` is the fixed, declared set (see
    ``declared_metric_keys``), so ``reduce`` is one all-reduce of a fixed size at any world size;
    reporting a key outside it is an error (``objective`` names the run's objective in that error)."""

    keys: Sequence[str]
    objective: str
    sums: Dict[str, float] = field(default_factory=dict)
    weights: Dict[str, float] = field(default_factory=dict)

    def add(self, metrics: Dict[str, float], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            if key not in self.keys:
                raise RuntimeError(
                    f"Metric `{key}` was reported but objective `{self.objective}` does not declare it (declared: "
                    f"{', '.join(self.keys)}). Add it to the METRIC_KEYS of whatever reports it: the objective's "
                    "module, the humanline transform or the data source."
                )
            self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def reduce(self, engine, totals: Sequence[float] = ()) -> Dict[str, float]:
        """The means; with ``totals``, one reduction also sums those numbers over ranks: ``(means, sums)``."""
        keys = self.keys
        local = torch.tensor([self.sums.get(k, 0.0) for k in keys] + [self.weights.get(k, 0.0) for k in keys]
                             + [float(v) for v in totals], dtype=torch.float64)
        total = engine.all_reduce_sum(local)
        n = len(keys)
        means = {k: total[i].item() / total[n + i].item() for i, k in enumerate(keys) if total[n + i].item() > 0}
        return (means, total[2 * n:].tolist()) if len(totals) else means


def declared_metric_keys(objective, transform, source_keys: Sequence[str] = ()) -> Tuple[str, ...]:
    """Every metric a micro-batch (or an evaluation) may report, sorted: ``loss``, the objective's
    ``metric_keys``, the humanline transform's and the data source's ``METRIC_KEYS`` (``source_keys``)."""
    return tuple(sorted({"loss", *objective.metric_keys, *transform.METRIC_KEYS, *source_keys}))


class Trainer(TrainerSafety):
    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.output_dir = Path(recipe.output_dir)

    # ---------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        from .data.build import build_datasets, held_out_reward
        from .modeling import load_tokenizer

        recipe = self.recipe
        self.signals = StopSignals().install()  # SIGTERM/SIGINT: checkpoint at the next update boundary
        check_recipe(recipe)
        if recipe.train.num_threads:
            torch.set_num_threads(recipe.train.num_threads)
        if recipe.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.tokenizer = load_tokenizer(recipe.model)
        self.engine = build_engine(recipe, self.tokenizer)
        self.is_main = self.engine.rank == 0
        self.objective = OBJECTIVES[recipe.objective.name]
        # seeded by the data-parallel rank: tensor/pipeline-parallel peers must draw the same rejections
        self.transform = build_transform(recipe.humanline, seed=recipe.train.seed + 1000 * self.engine.dp_rank)
        self.train_data, self.eval_data = build_datasets(recipe, self.tokenizer, show_progress=self.is_main)
        self.collate = self.train_data.collate
        order = DataOrder(len(self.train_data), recipe.train.seed, recipe.data.shuffle)
        self.logps_temperature = 1.0
        if recipe.rollout.every is not None:
            from .data.build import data_kind_of_objective, example_collate
            from .rollout import RolloutSource

            if self.objective.logps_at_sampling_temperature:
                self.logps_temperature = recipe.rollout.temperature
            self.source = RolloutSource(
                recipe, self.engine, self.tokenizer, self.train_data, example_collate(recipe, self.tokenizer),
                data_kind_of_objective(recipe), order, needs_old_logps(recipe), self.logps_temperature,
            )
        else:
            self.source = OfflineSource(self.engine, recipe.train.micro_batch_size, self.train_data, order,
                                        recipe.train.max_tokens_per_micro_batch)
        self.held_out = None  # held-out evaluation by the reward of sampled completions (eval.held_out)
        if self.eval_data is not None and held_out_reward(recipe):
            from .rollout.heldout import HeldOutReward

            self.held_out = HeldOutReward(recipe, self.engine, self.tokenizer, self.eval_data,
                                          getattr(self.source, "sampler", None), getattr(self.source, "reward", None))
        self.metric_keys = declared_metric_keys(self.objective, self.transform, self.source.METRIC_KEYS)
        self.eval_metric_keys = declared_metric_keys(self.objective, self.transform,
                                                     self.held_out.METRIC_KEYS if self.held_out else ())

        # the reference's log-probs: its copy, or computed by the policy (cached before training, or at each sync)
        loss_evals = self.eval_data is not None and self.held_out is None and recipe.eval.every is not None
        self.reference = build_reference_logps(recipe, self.engine, self.source.batches,
                                               self._eval_batches if loss_evals else None, self._evaluates_at,
                                               show_progress=self.is_main)
        self.sync_hook = self.reference.sync_hook  # before each optimizer step: sync, or compute ahead
        self._print(f"reference log-probs: {self.reference.mode} ({self.reference.reason})")
        self.updates_done = 0
        self.eval_history: List[Dict[str, float]] = []
        self.skips = SkipCounter(recipe.train.max_skipped_updates)
        self._stop_seen, self._signal_seen = None, False
        resume_from, notice = ckpt.resume_target(recipe.checkpoint.resume, self.output_dir)
        if notice:
            self._print(notice)
        if resume_from is not None:
            directory, tag = resume_from.parent, resume_from.name
            state = self.engine.load(str(directory), tag)
            self.updates_done = int(state.get("updates_done", 0))
            self.eval_history = list(state.get("eval_history", []))
            self.skips = SkipCounter(recipe.train.max_skipped_updates, *state.get("skipped", (0, 0)))
            if hasattr(self.transform, "load_state_dict") and "transform_state" in state:
                self.transform.load_state_dict(state["transform_state"])
            source_state = Path(directory) / tag / f"source_rank{self.engine.rank:05d}.pt"
            if hasattr(self.source, "load_state_dict") and source_state.exists():
                self.source.load_state_dict(ckpt.safe_load(source_state))
            notice = self.reference.resume(Path(directory) / tag, self.engine.rank)  # look-ahead: the window's log-probs
            if notice:
                self._print(notice)
            self._print(f"Resumed from {directory}/{tag} at update {self.updates_done}.")
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "recipe.resolved.yaml").write_text(recipe_to_yaml(recipe))
        self.sinks = Sinks.from_recipe(recipe, self.output_dir, self.updates_done) if self.is_main else None
        self.engine.barrier()

    # ---------------------------------------------------------------------------------------- train
    def train(self) -> Dict[str, float]:
        recipe = self.recipe
        if recipe.eval.every is not None and recipe.eval.at_start and self.updates_done == 0:
            self._evaluate()
        bar = self._progress_bar()
        step_times, sync_times, rollout_times = [], [], []
        run_start = time.perf_counter()
        stop_at = recipe.train.max_steps
        if recipe.train.stop_after is not None:
            stop_at = min(stop_at, self.updates_done + recipe.train.stop_after)
        while self.updates_done < stop_at:
            if self._stop_requested():
                stop_at = self.updates_done  # checkpoint below, then exit (SLURM time limit, preemption, a signal)
                why = (f"{self.signals.name() or 'a signal'} received" if self._signal_seen
                       else f"{STOP_FILE} found in {self.output_dir}")
                self._print(f"{why}: checkpointing at update {self.updates_done} and stopping.")
                break
            row = self.train_step()
            step_times.append(row["step_time_s"])
            sync_times.append(row["sync_time_s"])
            rollout_times.append(row.get("rollout_time_s", 0.0))
            self._log(row, bar)
            self._after_nonfinite_check(row, bar)
            if self._evaluates_at(self.updates_done):
                self._evaluate(bar)
            every = recipe.checkpoint.save_every
            if every is not None and self.updates_done % every == 0:
                self._save_checkpoint()
        if stop_at == self.updates_done < recipe.train.max_steps and not self._checkpoint_exists(self.updates_done):
            self._save_checkpoint()
        if self.is_main and (self.output_dir / STOP_FILE).exists():
            (self.output_dir / STOP_FILE).unlink()
        if bar is not None:
            bar.close()
        finished = self.updates_done >= recipe.train.max_steps
        if not finished:
            self._print(f"Stopped after update {self.updates_done}; resume with checkpoint.resume=auto.")
        if recipe.checkpoint.save_final and finished:
            self._save_final()
        exit_code = EXIT_INTERRUPTED if self._signal_seen and not finished else 0
        summary = self._summary(step_times, sync_times, rollout_times, time.perf_counter() - run_start, exit_code)
        if self.is_main:
            self.sinks.close()
        return summary

    def train_step(self) -> Dict[str, float]:
        """One optimizer update: [rollout] -> micro-batches -> backward; humanline sync; optimizer step.
        Returns its metrics row."""
        engine = self.engine
        n = self.updates_done
        step_start = time.perf_counter()
        rollout_metrics = self.source.before_step(n)
        acc, tokens = _Accumulator(self.metric_keys, self.objective.name), 0
        flags, detail = GuardFlags(), None
        batches = self.source.batches(n)
        # each micro-batch's share of the update's loss; the update's statistics (KTO's z0)
        update = UpdateNormaliser(self.objective, self.recipe.objective, batches, engine, self.transform.METRIC_KEYS)
        update.prepare(self.reference.token_logps, self.transform)
        for micro_index, batch in enumerate(batches):
            tokens += 0 if batch.get("dummy") else int(batch["attention_mask"].sum())
            loss, metrics = self._loss(batch, train=True)
            engine.mark_accumulation_boundary(micro_index == len(batches) - 1)
            engine.backward(update.scaled(micro_index, loss))
            metrics = {k: float(v) for k, v in metrics.items()}
            update.add(micro_index, float(loss.detach()), metrics)
            flags.loss = max(flags.loss, float(not math.isfinite(float(loss.detach()))))
            detail = detail or first_nonfinite(metrics)
            if micro_index < len(batches) - 1:
                engine.step()  # between accumulation boundaries: no optimizer step
        update.finish(acc)
        flags.statistics = float(detail is not None)
        flags.grads = float(not engine.local_grads_finite())
        detail = "loss" if flags.loss else detail
        # one reduction per update carries the guard (non-finite values on any rank, a pending signal, rank 0's
        # view of the STOP file) and the token count, before the reference sync and the optimizer step
        flags.stop_file = float(self.is_main and (self.output_dir / STOP_FILE).exists())
        flags.signal = float(self.signals.requested)
        guard = engine.all_reduce_sum(torch.tensor([float(tokens), *flags.values()], dtype=torch.float64))
        seen = GuardFlags.from_sums(guard[1:].tolist())
        self._stop_seen, self._signal_seen = bool(seen.stop_file or seen.signal), bool(seen.signal)
        nonfinite = seen.nonfinite()
        if nonfinite is None:
            # after the last backward (gradient clipping happens inside step), before the optimizer step
            sync = self.sync_hook.before_optimizer_step(engine, n)
            stepped = engine.step()
        else:  # no optimizer step, reference untouched (`stop` ends the run after logging this row)
            sync, stepped = SyncRecord(False, 0.0), engine.skip_step()
        engine.synchronize()
        pause_for_test(SLOW_UPDATES_ENV)
        step_time = time.perf_counter() - step_start
        self.updates_done += 1
        acc.add({k: float(v) for k, v in rollout_metrics.items() if k != "rollout"})
        means, totals = acc.reduce(engine, totals=(sync.seconds, step_time))
        row = {"step": n, **finish_metrics(self.objective, means)}
        row.update(
            lr=stepped["lr"], grad_norm=stepped["grad_norm"], synced=sync.synced, skipped=nonfinite is not None,
            step_time_s=totals[1] / engine.world_size, sync_time_s=totals[0] / engine.world_size,
        )
        # tensor/pipeline-parallel peers see the same tokens: count each data-parallel replica once
        row["tokens_per_s"] = guard[0].item() * engine.dp_size / engine.world_size / max(row["step_time_s"], 1e-9)
        self.nonfinite = (nonfinite, detail) if nonfinite is not None else None  # acted on once the row is logged
        if "rollout" in rollout_metrics:
            row["rollout"] = bool(rollout_metrics["rollout"])
            row["train_time_s"] = row["step_time_s"] - row["rollout_time_s"]
        return row

    def _loss(self, batch, train: bool):
        """Token log-probs of both models -> humanline transform -> the objective's loss and metrics."""
        engine = self.engine
        temperature = self.logps_temperature
        with torch.set_grad_enabled(train):
            policy_logps = engine.token_logps(batch, "policy", temperature)
        if self.reference.available:
            ref_logps = self.reference.logps(batch, temperature, policy_logps)
        else:
            ref_logps = policy_logps.detach()  # log-ratios are 0: the objective ignores them
        mask = batch["completion_mask"].to(device=policy_logps.device, dtype=policy_logps.dtype)
        log_ratios, hl_metrics = self.transform(policy_logps, ref_logps, mask)
        inputs = ObjectiveInputs(
            batch=batch, policy_logps=policy_logps, ref_logps=ref_logps, mask=mask, log_ratios=log_ratios,
            transform=self.transform, token_logps=self.reference.token_logps,
            humanline_active=self.recipe.humanline.enabled, has_reference=self.reference.available,
            update_normalised=train,
        )
        loss, metrics = self.objective.batch_loss(self.recipe.objective, inputs)
        return loss, {**metrics, **hl_metrics}

    # ---------------------------------------------------------------------------------------- eval
    @torch.no_grad()
    def _evaluate(self, bar=None) -> Dict[str, float]:
        """Held-out loss and objective metrics over the whole eval split (sharded over ranks)."""
        engine, recipe = self.engine, self.recipe
        acc = _Accumulator(self.eval_metric_keys, self.objective.name)
        if self.held_out is not None:  # held-out reward of fresh samples instead of an offline loss
            metrics, weight = self.held_out.evaluate(self.eval_data, self.updates_done)
            acc.add(metrics, weight=weight)
        for batch, real in self._eval_batches(with_rows=True) if self.held_out is None else ():
            loss, metrics = self._loss(batch, train=False)
            acc.add({"loss": float(loss), **metrics}, weight=float(real))
        result = acc.reduce(engine)
        row = {"kind": "eval", "step": self.updates_done, **result}
        self.eval_history.append({k: v for k, v in row.items() if k != "kind"})
        if self.is_main:
            self.sinks.write(row)
            shown = {k: result[k] for k in ("loss", "rewards/accuracy", "policy/accuracy", "reward", "win_rate_vs_start")
                     if k in result}
            self._print(f"eval @ {self.updates_done}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()), bar)
        return result

    def _eval_batches(self, with_rows: bool = False):
        """This rank's eval micro-batches (``data.build.eval_batches``), with their real row counts if asked."""
        from .data.build import eval_batches

        recipe, engine = self.recipe, self.engine
        for batch, real in eval_batches(self.collate, self.eval_data, recipe.eval.batch_size or recipe.train.micro_batch_size,
                                        engine.dp_rank, engine.dp_size, recipe.eval.max_batches):
            yield (batch, real) if with_rows else batch

    def _evaluates_at(self, updates_done: int) -> bool:
        every = self.recipe.eval.every
        return every is not None and (updates_done % every == 0 or updates_done == self.recipe.train.max_steps)

    # ---------------------------------------------------------------------------------------- save
    def _stop_requested(self) -> bool:
        """True on every rank when ``<output_dir>/STOP`` exists on rank 0 (a launcher's request to stop) or a
        rank got SIGTERM/SIGINT. After an update this was already shared in its guard reduction; before the
        first, ask now."""
        if self._stop_seen is not None:
            return self._stop_seen
        flags = [float(self.is_main and (self.output_dir / STOP_FILE).exists()), float(self.signals.requested)]
        seen = self.engine.all_reduce_sum(torch.tensor(flags, dtype=torch.float64))
        self._signal_seen = seen[1].item() > 0
        return seen.sum().item() > 0

    # ---------------------------------------------------------------------------------------- output
    def _progress_bar(self):
        if not (self.is_main and self.recipe.logging.progress_bar):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.recipe.train.max_steps, initial=self.updates_done, desc=self.recipe.name, unit="step", dynamic_ncols=True)

    def _log(self, row: Dict, bar) -> None:
        if not self.is_main:
            return
        self.sinks.write(row)
        if bar is not None:
            post = {"loss": f"{row['loss']:.4f}"}
            if "rewards/accuracy" in row:
                post["acc"] = f"{row['rewards/accuracy']:.2f}"
            if "unclamped_frac" in row:
                post["unclamped"] = f"{row['unclamped_frac']:.2f}"
            bar.set_postfix(post)
            bar.update(1)
        elif row["step"] % self.recipe.logging.log_every == 0:
            self._print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}))

    def _print(self, text: str, bar=None) -> None:
        if not getattr(self, "is_main", True):
            return
        if bar is not None:
            bar.write(text)
        else:
            print(text, flush=True)

    def _summary(self, step_times, sync_times, rollout_times, wall, exit_code: int) -> Dict[str, float]:
        summary = {"updates": self.updates_done, "wall_s": wall, "torch_threads": torch.get_num_threads(),
                   "deterministic": torch.are_deterministic_algorithms_enabled(), "skipped_updates": self.skips.total,
                   "exit_code": exit_code}
        if step_times:
            mean_step = sum(step_times) / len(step_times)
            total = max(sum(step_times), 1e-12)
            summary.update(mean_step_s=mean_step, sync_frac=sum(sync_times) / total,
                           rollout_s=sum(rollout_times), rollout_frac=sum(rollout_times) / total)
        if self.eval_history:
            first, last = self.eval_history[0], self.eval_history[-1]
            for key in SUMMARY_EVAL_KEYS:
                if key in first and key in last:
                    summary[f"eval_start/{key}"] = first[key]
                    summary[f"eval_end/{key}"] = last[key]
        from .data.build import data_summary_fields  # truncated / dropped examples

        summary.update(data_summary_fields(self.train_data, self.eval_data))
        if self.is_main:
            lines = [f"== {self.recipe.name}: {self.updates_done} updates in {wall:.1f}s =="]
            if step_times:
                sync = "look-ahead reference forwards" if self.reference.mode == "lookahead" else "reference sync"
                lines.append(f"mean step {summary['mean_step_s']:.3f}s, {sync} {100 * summary['sync_frac']:.2f}% of step time")
                if self.recipe.rollout.every is not None:
                    lines.append(
                        f"wall-clock split: generation + scoring {summary['rollout_s']:.1f}s "
                        f"({100 * summary['rollout_frac']:.1f}%), training {sum(step_times) - summary['rollout_s']:.1f}s"
                    )
            if self.eval_history:
                lines.append(f"held-out, start (update {self.eval_history[0]['step']}) -> end (update {self.eval_history[-1]['step']}):")
            for key, label in SUMMARY_EVAL_KEYS.items():
                if f"eval_start/{key}" in summary:
                    lines.append(f"  {label}: {summary[f'eval_start/{key}']:.3f} -> {summary[f'eval_end/{key}']:.3f}")
            lines.append(f"outputs: {self.output_dir}/metrics.jsonl, checkpoints/, final/")
            print("\n".join(lines), flush=True)
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def close(self, destroy_process_group: bool = True) -> None:
        if getattr(self, "signals", None) is not None:
            self.signals.uninstall()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(destroy_process_group)


def run(recipe: Recipe, after_training: Optional[Callable[[Recipe, Path], object]] = None) -> Dict[str, float]:
    """Setup, train, save; always tears the engine down. Then, on rank 0 when the run finished with a
    ``final/`` model and ``eval.after_training`` is on, ``after_training(recipe, final_dir)`` (the launcher
    passes the post-training evals); its result goes into the returned summary as ``post_training_eval``."""
    trainer = Trainer(recipe)
    try:
        trainer.setup()
        summary = trainer.train()
    finally:
        is_main = getattr(trainer, "is_main", False)
        trainer.close()
    final = Path(recipe.output_dir) / "final"
    if (after_training is not None and is_main and recipe.eval.after_training
            and summary.get("updates", 0) >= recipe.train.max_steps and final.exists()):
        summary["post_training_eval"] = after_training(recipe, final)
    return summary
