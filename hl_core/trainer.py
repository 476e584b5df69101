"""The one training loop. Reads top to bottom: setup, train, evaluate, save.

Per optimizer update ``n`` (``n`` = updates already done):

    micro-batches: fixed or by token budget, each weighted by its share of the update (hl_core.loop.micro_batches)
    for each micro-batch:  policy/reference token log-probs -> humanline transform -> objective -> backward
    the guard's reduction; unless skipped: humanline sync (n % k == 0: the reference's ``before_optimizer_step``),
    the callbacks' ``before_optimizer_step``, optimizer step (clipping inside); metrics, periodic eval and checkpoint

It knows nothing of DeepSpeed or Megatron internals: everything goes through ``hl_core.engines.Engine``. It reads
the whole recipe and hands each component its section, or an answer ``hl_core.config.decisions`` drew from several;
the machinery it drives (data order, guard, checkpoints, metrics, output) lives in ``hl_core.loop``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .callbacks import CallbackContext, CallbackList, LoopCallback, build_callbacks
from .config import Recipe, batch_layout, check_recipe, decide, recipe_to_yaml, reference_cache_fields
from .config.checks import env_world_size
from .data.build import build_datasets, data_summary_fields, eval_batches, example_collate
from .engines import build_engine
from .engines.base import check_launch_environment
from .humanline import SyncRecord
from .humanline.recipe import build_transform
from .loop.guard import EXIT_INTERRUPTED, GuardFlags, SkipCounter, StopSignals, UpdateChecks
from .loop.lifecycle import STOP_FILE, already_complete, begin_run
from .loop.metrics import MetricMeans, declared_metric_keys
from .loop.micro_batches import UpdateNormaliser, finish_metrics
from .loop.post_training import announce, run_post_training
from .loop.report import RunReport, StepTimes, configure_bars
from .loop.run_record import run_record
from .loop.safety import CheckpointParts, Progress, RunSafety, SafetySettings
from .loop.sources import OfflineSource, data_order, epoch_steps
from .models.loading import load_tokenizer
from .objectives import OBJECTIVES, ObjectiveInputs
from .reference import build_reference_logps, cache_location
from .rollout import RolloutSource
from .rollout.heldout import HeldOutReward
from .storage import checkpoints as ckpt, gguf_models


class Trainer:
    """The loop; ``callbacks`` (``hl_core.callbacks.LoopCallback``) run after the recipe's."""

    def __init__(self, recipe: Recipe, callbacks: Sequence[LoopCallback] = ()):
        self.recipe = recipe
        self.output_dir = Path(recipe.output_dir)
        self.extra_callbacks = list(callbacks)
        self.callback_state: Dict[str, object] = {}  # the callbacks' ``user_state``, for the whole run

    # ---------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        recipe = self.recipe
        recipe.model = gguf_models.resolve_model(recipe.model)  # a gguf: model converted (once) as it is built
        self.signals = StopSignals().install()  # SIGTERM/SIGINT: checkpoint at the next update boundary
        check_recipe(recipe)
        self.decided = decide(recipe)  # what several sections decide together, handed out below with the sections
        check_launch_environment()  # RANK, WORLD_SIZE, ...: refused before anything waits on them
        rank0 = os.environ.get("RANK", "0").strip() == "0"
        self.bars = configure_bars(recipe.logging.progress_bar, rank0)
        if recipe.train.num_threads:
            torch.set_num_threads(recipe.train.num_threads)
        if recipe.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.tokenizer = load_tokenizer(recipe.model)
        # before the resume checks and the engine: `train.epochs` sets `train.max_steps`, the LR schedule's length
        layout = self._load_data(rank0)
        # this run's record, the output_dir's lock (rank 0), what to resume and whether it may: before any weights
        self.start = begin_run(self.output_dir, recipe.checkpoint, run_record(recipe, env_world_size() or 1), rank0)
        self.engine = build_engine(recipe, self.tokenizer)
        if layout not in (None, (self.engine.dp_size, self.engine.gradient_accumulation_steps)):
            raise RuntimeError(f"`train.epochs` was derived for (dp, accumulation) = {layout}, but the engine has "
                               f"{(self.engine.dp_size, self.engine.gradient_accumulation_steps)}")
        self.is_main = self.engine.rank == 0
        self.report = RunReport(self.is_main, self.output_dir, recipe.logging, recipe.name, self.bars)
        self.objective = OBJECTIVES[recipe.objective.name]
        # seeded by the data-parallel rank: tensor/pipeline-parallel peers must draw the same rejections
        self.transform = build_transform(recipe.humanline, seed=recipe.train.seed + 1000 * self.engine.dp_rank)
        self._setup_data()
        self._setup_reference()
        self.updates_done = 0
        self.eval_history: List[Dict[str, float]] = []
        self.skips = SkipCounter(recipe.train.max_skipped_updates)
        self._stop_seen, self._signal_seen = None, False
        parts = CheckpointParts(self.transform, self.source, self.reference,
                                lambda path: self.callbacks.on_save(self.context(), path))
        self.safety = RunSafety(self.engine, self.output_dir, self.report, SafetySettings(
            recipe.train.on_nonfinite, recipe.checkpoint.keep_last, self.start.record), parts)
        for notice in self.start.notices:
            self.report.print(notice)
        self._resume()
        if self.is_main:
            (self.output_dir / "recipe.resolved.yaml").write_text(recipe_to_yaml(recipe))
        self.report.open(self.updates_done, recipe.model_dump(mode="json"))
        self.engine.barrier()

    def _load_data(self, main: bool) -> Optional[tuple]:
        """The datasets. With `train.epochs`, `train.max_steps` derived from the train split's size and the batch
        layout (returned, for the engine to confirm), set on the recipe in its place, and logged (``main``: rank 0 of
        the launch)."""
        recipe = self.recipe
        self.train_data, self.eval_data = build_datasets(recipe.data, self.decided.data, self.tokenizer,
                                                         show_progress=main, bars=self.bars)
        if recipe.train.epochs is None:
            return None
        layout = batch_layout(recipe, env_world_size() or 1)
        steps, line = epoch_steps(recipe.train, len(self.train_data), *layout)
        recipe.train = recipe.train.model_copy(update={"max_steps": steps, "epochs": None})
        if main:
            print(line, flush=True)
        return layout

    def _setup_data(self) -> None:
        """Where each update's micro-batches come from, and the held-out evaluation."""
        recipe, engine, decided, plan = self.recipe, self.engine, self.decided, self.decided.data
        self.collate = self.train_data.collate
        order = data_order(self.train_data, recipe.train.seed, recipe.data.shuffle)
        self.logps_temperature = 1.0
        if recipe.rollout.every is not None:
            if self.objective.logps_at_sampling_temperature:
                self.logps_temperature = recipe.rollout.temperature
            self.source = RolloutSource(decided.sampling, recipe.train, self.output_dir, engine, self.tokenizer,
                                        self.train_data, example_collate(plan, self.tokenizer), plan.example_kind,
                                        order, decided.needs_old_logps, self.logps_temperature)
        else:
            self.source = OfflineSource(engine, recipe.train.micro_batch_size, self.train_data, order,
                                        recipe.train.max_tokens_per_micro_batch)
        self.held_out = None  # held-out evaluation by the reward of sampled completions (eval.held_out)
        if self.eval_data is not None and decided.held_out_reward:
            self.held_out = HeldOutReward(decided.sampling, self.output_dir, engine, self.tokenizer, self.eval_data,
                                          getattr(self.source, "sampler", None), getattr(self.source, "reward", None))
        self.metric_keys = declared_metric_keys(self.objective, self.transform, self.source.METRIC_KEYS)
        self.eval_metric_keys = declared_metric_keys(self.objective, self.transform,
                                                     self.held_out.METRIC_KEYS if self.held_out else ())

    def _setup_reference(self) -> None:
        """The reference's log-probs: its copy, or computed by the policy (cached before training, or at each sync)."""
        recipe = self.recipe
        mode, reason = self.decided.reference_mode
        loss_evals = self.eval_data is not None and self.held_out is None and recipe.eval.every is not None
        self.reference = build_reference_logps(
            mode, reason, recipe.humanline, recipe.train.max_steps, self.engine, self.source.batches,
            self._eval_batches if loss_evals else None, self._evaluates_at,
            cache=cache_location(self.output_dir, reference_cache_fields(recipe), self.engine) if mode == "cached"
            else None, show_progress=self.is_main, bars=self.bars,
        )
        self.callbacks = CallbackList([*build_callbacks(recipe.train.callbacks), *self.extra_callbacks])
        self.report.print(f"reference log-probs: {self.reference.mode} ({self.reference.reason})")

    def _resume(self) -> None:
        """``checkpoint.resume``: the checkpoint ``begin_run`` chose and checked (the newest complete one for
        ``auto``, a named one, or none)."""
        resume_from = self.start.target
        if resume_from is None:
            return
        progress, notices = self.safety.restore(resume_from, self.recipe.train.max_skipped_updates,
                                                self.start.eval_changed)
        self.updates_done, self.skips, self.eval_history = progress.updates_done, progress.skips, progress.eval_history
        for notice in notices:
            self.report.print(notice)
        self.report.print(f"Resumed from {resume_from} at update {self.updates_done}.")

    # ---------------------------------------------------------------------------------------- train
    def train(self) -> Dict[str, float]:
        recipe = self.recipe
        if self.start.target is not None and self.updates_done >= recipe.train.max_steps:
            return self._already_complete()
        if recipe.eval.every is not None and recipe.eval.at_start and self.updates_done == 0:
            self._evaluate()
        self.report.start_progress(recipe.train.max_steps, self.updates_done)
        times, run_start = StepTimes(), time.perf_counter()
        stop_at = recipe.train.max_steps
        if recipe.train.stop_after is not None:
            stop_at = min(stop_at, self.updates_done + recipe.train.stop_after)
        while self.updates_done < stop_at:
            if self._stop_requested():
                stop_at = self.updates_done  # checkpoint below, then exit (SLURM time limit, preemption, a signal)
                why = (f"{self.signals.name() or 'a signal'} received" if self._signal_seen
                       else f"{STOP_FILE} found in {self.output_dir}")
                self.report.print(f"{why}: checkpointing at update {self.updates_done} and stopping.")
                break
            row = self.train_step()
            times.add(row)
            self.report.update(row)
            self.callbacks.after_update(self.context(), row)
            self.safety.after_update(row, self.nonfinite, self.progress())
            if self._evaluates_at(self.updates_done):
                self._evaluate()
            every = recipe.checkpoint.save_every
            if every is not None and self.updates_done % every == 0:
                self.safety.save_checkpoint(self.progress())
        # stopped early: resumable; finished: extendable (`train.max_steps` raised), when checkpoints are on
        keep = stop_at == self.updates_done < recipe.train.max_steps or (
            self.updates_done >= recipe.train.max_steps and recipe.checkpoint.save_every is not None)
        if keep and not self.safety.checkpoint_exists(self.updates_done):
            self.safety.save_checkpoint(self.progress())
        if self.is_main and (self.output_dir / STOP_FILE).exists():
            (self.output_dir / STOP_FILE).unlink()
        self.report.stop_progress()
        finished = self.updates_done >= recipe.train.max_steps
        if not finished:
            self.report.print(f"Stopped after update {self.updates_done}; resume with checkpoint.resume=auto.")
        if recipe.checkpoint.save_final and finished:
            self.safety.save_final(self.progress())
        exit_code = EXIT_INTERRUPTED if self._signal_seen and not finished else 0
        sync_label = "look-ahead reference forwards" if self.reference.mode == "lookahead" else "reference sync"
        summary = self.report.summary(
            self.updates_done, time.perf_counter() - run_start, times, self.eval_history, self.skips.total, exit_code,
            {**data_summary_fields(self.train_data, self.eval_data), **self.engine.summary_fields()}, sync_label,
            recipe.rollout.every is not None,
        )
        self.report.close()
        return summary

    def _already_complete(self) -> Dict[str, float]:
        """A rerun of a finished run: nothing to train (``final/`` written if it is missing); says how to extend."""
        final = self.output_dir / ckpt.FINAL_DIR
        if self.recipe.checkpoint.save_final and not self.safety.rank0_says(final.is_dir()):
            self.safety.save_final(self.progress())
        self.report.print(already_complete(self.output_dir, self.updates_done, self.safety.rank0_says(final.is_dir())))
        self.report.close()
        return {"updates": self.updates_done, "exit_code": 0, "already_complete": True}

    def train_step(self) -> Dict[str, float]:
        """One optimizer update: [rollout] -> micro-batches -> backward; humanline sync; optimizer step.
        Returns its metrics row."""
        engine, n = self.engine, self.updates_done
        step_start = time.perf_counter()
        rollout_metrics = self.source.before_step(n)
        acc, tokens = MetricMeans(self.metric_keys, self.objective.name), 0
        checks = UpdateChecks()  # the guard's non-finite checks, on the device until the update's one reduction
        batches = self.source.batches(n)
        # each micro-batch's share of the update's loss; the update's statistics (KTO's z0)
        update = UpdateNormaliser(self.objective, self.recipe.objective, batches, engine, self.transform.METRIC_KEYS)
        update.prepare(self.reference.token_logps, self.transform)
        for micro_index, batch in enumerate(batches):
            tokens += 0 if batch.get("dummy") else int(batch["attention_mask"].sum())  # the collated batch: host
            loss, metrics = self._loss(batch, train=True)
            engine.mark_accumulation_boundary(micro_index == len(batches) - 1)
            engine.backward(update.scaled(micro_index, loss))
            update.add(micro_index, loss.detach(), metrics)  # loss and metrics stay device tensors: no host read
            checks.add(loss, metrics)
            if micro_index < len(batches) - 1:
                engine.step()  # between accumulation boundaries: no optimizer step
        update.finish(acc)
        # one reduction per update carries the guard (non-finite values on any rank, a pending signal, rank 0's
        # view of the STOP file) and the token count, before the reference sync and the optimizer step
        stop_file = float(self.is_main and (self.output_dir / STOP_FILE).exists())
        guard = engine.all_reduce_sum(checks.vector(tokens, stop_file, float(self.signals.requested),
                                                    engine.local_grads_nonfinite(), engine.device)).tolist()
        seen = GuardFlags.from_sums(guard[1:])
        self._stop_seen, self._signal_seen = bool(seen.stop_file or seen.signal), bool(seen.signal)
        nonfinite = seen.nonfinite()
        if nonfinite is None:
            # after the last backward (clipping is inside step), before the optimizer step: the sync, then callbacks
            sync = self.reference.before_optimizer_step(n)
            self.callbacks.before_optimizer_step(self.context(), sync)
            stepped = engine.step()
        else:  # no optimizer step, reference untouched (`stop` ends the run after logging this row)
            sync, stepped = SyncRecord(False, 0.0), engine.skip_step()
        engine.synchronize()
        step_time = time.perf_counter() - step_start
        self.updates_done += 1
        acc.add({k: float(v) for k, v in rollout_metrics.items() if k != "rollout"})
        # the gradient norm (a device tensor or a number; the same on every rank) travels as rank 0's in the totals
        norm = stepped["grad_norm"] if engine.rank == 0 else 0.0
        means, totals = acc.reduce(engine, totals=(sync.seconds, step_time, norm))
        row = {"step": n, **finish_metrics(self.objective, means)}
        row.update(
            lr=stepped["lr"], grad_norm=totals[2], synced=sync.synced, skipped=nonfinite is not None,
            step_time_s=totals[1] / engine.world_size, sync_time_s=totals[0] / engine.world_size,
        )
        row["tokens_per_s"] = guard[0] * engine.dp_size / engine.world_size / max(row["step_time_s"], 1e-9)
        # acted on once the row is logged
        self.nonfinite = (nonfinite, checks.detail()) if nonfinite is not None else None
        if "rollout" in rollout_metrics:
            row["rollout"] = bool(rollout_metrics["rollout"])
            row["train_time_s"] = row["step_time_s"] - row["rollout_time_s"]
        return row

    def progress(self) -> Progress:
        return Progress(self.updates_done, self.skips, self.eval_history)  # what a checkpoint or a stop records

    def context(self) -> CallbackContext:
        """What a callback reads (``hl_core.callbacks.CallbackContext``)."""
        return CallbackContext(self.updates_done, self.engine, self.output_dir, self.callback_state)

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

    # ---------------------------------------------------------------------------------------- evaluate
    def _evaluate(self) -> Dict[str, float]:
        """Held-out loss and objective metrics over the whole eval split (sharded over ranks), the policy in eval
        mode: no dropout, so it neither varies nor draws from the training's generators."""
        with self.engine.policy_as_reference():
            return self._evaluate_in_eval_mode()

    def _evaluate_in_eval_mode(self) -> Dict[str, float]:
        acc = MetricMeans(self.eval_metric_keys, self.objective.name)
        if self.held_out is not None:  # held-out reward of fresh samples instead of an offline loss
            metrics, weight = self.held_out.evaluate(self.eval_data, self.updates_done)
            acc.add(metrics, weight=weight)
        for batch, real in self._eval_batches(with_rows=True) if self.held_out is None else ():
            loss, metrics = self._loss(batch, train=False)
            acc.add({"loss": loss.detach(), **metrics}, weight=float(real))
        result = acc.reduce(self.engine)
        row = {"kind": "eval", "step": self.updates_done, **result}
        self.eval_history.append({k: v for k, v in row.items() if k != "kind"})
        self.report.evaluation(row)
        return result

    def _eval_batches(self, with_rows: bool = False):
        """This rank's eval micro-batches (``data.build.eval_batches``), with their real row counts if asked."""
        recipe, engine = self.recipe, self.engine
        size = recipe.eval.batch_size or recipe.train.micro_batch_size
        for batch, real in eval_batches(self.collate, self.eval_data, size,
                                        engine.dp_rank, engine.dp_size, recipe.eval.max_batches):
            yield (batch, real) if with_rows else batch

    def _evaluates_at(self, updates_done: int) -> bool:
        every = self.recipe.eval.every
        return every is not None and (updates_done % every == 0 or updates_done == self.recipe.train.max_steps)

    # ---------------------------------------------------------------------------------------- stop and save
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

    def close(self, destroy_process_group: bool = True, keep_lock: bool = False) -> None:
        """Signal handlers back, engines torn down, the ``output_dir`` lock released (``keep_lock``: not yet);
        a second call does only what the first left."""
        if getattr(self, "signals", None) is not None:
            self.signals.uninstall()
        sampler = getattr(getattr(self, "source", None), "sampler", None)
        if sampler is not None and hasattr(sampler, "close"):  # vLLM first: it joined the engine's process group
            sampler.close()
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close(destroy_process_group)
        lock = getattr(getattr(self, "start", None), "lock", None)
        if lock is not None and not keep_lock:
            lock.release()


def run(recipe: Recipe, after_training: Optional[Callable[[Recipe, Path], object]] = None,
        callbacks: Sequence[LoopCallback] = ()) -> Dict[str, float]:
    """Setup, train, save; always tears the engine down. Then, on rank 0 when the run finished with a ``final/`` model
    and ``eval.after_training`` is on, ``after_training(recipe, final_dir)``, a module-level function called in a child
    process (the launcher passes the post-training evals; ``loop.post_training``), its result the summary's
    ``post_training_eval``; the lock is held until then."""
    trainer, record = Trainer(recipe, callbacks), None
    try:
        trainer.setup()
        summary = trainer.train()
        final = Path(recipe.output_dir) / ckpt.FINAL_DIR
        evaluates = (after_training is not None and trainer.is_main and recipe.eval.after_training and final.exists()
                     and summary.get("updates", 0) >= recipe.train.max_steps and not summary.get("already_complete"))
        if evaluates:  # from here a signal is recorded (with one the trainer's handlers hold), never the default
            record = announce(recipe.output_dir, summary, trainer.signals)
        trainer.close(keep_lock=True)
        if evaluates:
            summary = run_post_training(after_training, recipe, final, summary, record=record)
        return summary
    finally:
        if record is not None:
            record.restore()  # a second call does nothing
        trainer.close()
