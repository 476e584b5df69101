"""Every TRL and transformers internal the adapter touches, declared once (``INTERNALS``), checked when a humanline
trainer is built (``missing``), and rendered on the TRL page (``markdown``).

Kinds:

* ``method``: a method the adapter overrides or calls, with the leading parameters it relies on;
* ``helper``: a module-level function it imports or calls, with the parameters it passes by name;
* ``field``: a field of TRL's config it reads;
* ``attribute``: an attribute TRL's ``__init__`` sets that the adapter reads or swaps (checked on the built trainer);
* ``order``: a method whose body must call things in an order (its source read at construction).

The order of the policy's and the reference's forwards inside DPO's and KTO's ``_compute_loss`` is checked on the
first calls instead (``RUNTIME_CONTRACTS``; ``stand_ins.ReferenceFirst``), since it is TRL's behaviour, not its source.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from packaging.version import Version

FUSED_FROM = "1.15"  # the fused LM head (`add_fused_lm_head`) from this release on; before it, log-probs from logits
ALL = ("DPOTrainer", "KTOTrainer", "GRPOTrainer")
PAIRED = ("DPOTrainer", "KTOTrainer")


@dataclass(frozen=True)
class Internal:
    """One internal the adapter relies on.

    Args:
        owner: dotted path of what holds it (a class or a module; ``{module}`` stands for each trainer's module,
            ``{class}`` for each trainer's class).
        name: the attribute, method, function or field.
        kind: ``method``, ``helper``, ``field``, ``attribute`` or ``order``.
        needs: the parameters relied on (``method``: the leading ones after ``self``, in order; ``helper``: names
            it must accept); for ``order``, the calls its source must make, in this order.
        purpose: what the adapter does with it.
        trainers: the TRL trainers whose humanline subclass needs it.
        releases: ``""`` (every supported release), ``"<1.15"`` or ``">=1.15"``.
        deepspeed_only: needed (and checked) only when the trainer runs under DeepSpeed.
    """

    owner: str
    name: str
    kind: str
    needs: Tuple[str, ...]
    purpose: str
    trainers: Tuple[str, ...] = ALL
    releases: str = ""
    deepspeed_only: bool = False

    def owner_path(self, trainer: str = "") -> str:
        """``owner`` for ``trainer`` (without one: with placeholders a reader understands)."""
        return self.owner.replace("{module}", _trainer_module(trainer) if trainer else "trl.trainer.<x>_trainer") \
            .replace("{class}", f"trl.{trainer}" if trainer else "trl.<Trainer>")

    def label(self, trainer: str = "") -> str:
        owner = self.owner_path(trainer)
        if self.kind in ("method", "helper"):
            return f"`{owner}.{self.name}({', '.join(self.needs)})`"
        if self.kind == "order":
            return f"`{owner}.{self.name}` calling {' then '.join(f'`{n}`' for n in self.needs)}"
        return f"`{owner}.{self.name}`"

    def applies(self, trainer: str, version: str) -> bool:
        if trainer not in self.trainers:
            return False
        fused = uses_fused_head(version)
        return not self.releases or (self.releases == ">=1.15") == fused


T = "transformers.Trainer"
INTERNALS: Tuple[Internal, ...] = (
    # the objectives: TRL's loss code, run on humanline log-ratios
    Internal("trl.DPOTrainer", "_compute_loss", "method", ("model", "inputs", "return_outputs"),
             "runs TRL's DPO loss with the policy and reference stand-ins", ("DPOTrainer",)),
    Internal("trl.KTOTrainer", "_compute_loss", "method", ("model", "inputs", "return_outputs"),
             "runs TRL's KTO loss with the policy and reference stand-ins", ("KTOTrainer",)),
    Internal("trl.GRPOTrainer", "_compute_loss", "method", ("model", "inputs"),
             "runs TRL's GRPO loss with the ratio against the synced reference", ("GRPOTrainer",)),
    Internal("trl.GRPOTrainer", "_compute_loss", "order",
             ("self._get_per_token_logps_and_entropies(", 'inputs.get("old_per_token_logps")',
              'inputs.get("sampling_per_token_logps"', 'inputs["ref_per_token_logps"]'),
             "reads the inputs the adapter sets while it computes the policy's log-probs", ("GRPOTrainer",)),
    Internal("trl.GRPOTrainer", "_get_per_token_logps_and_entropies", "method", ("model",),
             "the policy's per-token log-probs, replaced by lp_ref + d_hl", ("GRPOTrainer",)),
    Internal("trl.GRPOTrainer", "_generate_and_score_completions", "method", ("inputs",),
             "offline groups: the batch built from the data, nothing generated", ("GRPOTrainer",)),
    Internal("trl.GRPOTrainer", "_set_signature_columns_if_needed", "method", (),
             "keeps the offline groups' columns", ("GRPOTrainer",)),
    Internal("trl.GRPOTrainer", "_get_train_sampler", "method", ("dataset",),
             "offline groups read in order", ("GRPOTrainer",)),
    Internal("trl.DPOTrainer", "_prepare_dataset", "method", ("dataset", "processing_class", "args", "dataset_name"),
             "token ids taken as given", ("DPOTrainer",)),
    Internal("trl.KTOTrainer", "_prepare_dataset", "method", ("dataset", "processing_class", "args", "dataset_name"),
             "token ids taken as given", ("KTOTrainer",)),
    # the log-probs the stand-ins transform
    Internal("trl.trainer.utils", "add_fused_lm_head", "helper", ("model", "temperature", "cast_lm_head_to_fp32"),
             "the fused LM head whose per-token log-probs the stand-ins transform", releases=">=1.15"),
    Internal("{module}", "selective_log_softmax", "helper", ("logits", "index", "row_mask"),
             "swapped for one call: the policy's log-probs become lp_ref + d_hl", PAIRED, "<1.15"),
    Internal("{module}", "selective_log_softmax_and_entropy", "helper", ("logits", "index", "row_mask"),
             "swapped for one call: the policy's log-probs become lp_ref + d_hl", PAIRED, "<1.15"),
    # the reference GRPO keeps at any beta
    Internal("trl.trainer.utils", "create_model_from_path", "helper", ("model_id",),
             "GRPO's reference under ZeRO-3, loaded as TRL loads its own", ("GRPOTrainer",)),
    Internal("trl.trainer.utils", "get_config_model_id", "helper", ("config",),
             "where GRPO's reference is loaded from", ("GRPOTrainer",)),
    Internal("trl.trainer.utils", "disable_dropout_in_model", "helper", ("model",),
             "GRPO's reference without dropout", ("GRPOTrainer",)),
    Internal("trl.models.utils", "prepare_deepspeed", "helper", ("model", "accelerator"),
             "GRPO's reference prepared as TRL prepares its own", ("GRPOTrainer",)),
    # what the adapter reads from TRL's trainers and configs
    Internal("{class}", "ref_model", "attribute", (), "the reference: synced, swapped for one call"),
    Internal("{class}", "_metrics", "attribute", (), "where humanline/clipped_frac is logged"),
    Internal("trl.GRPOTrainer", "beta", "attribute", (), "whether TRL adds its KL term", ("GRPOTrainer",)),
    Internal("trl.GRPOTrainer", "temperature", "attribute", (), "GRPO's reference fused head", ("GRPOTrainer",)),
    Internal("trl.GRPOTrainer", "num_generations", "attribute", (), "offline groups' size", ("GRPOTrainer",)),
    Internal("trl.DPOConfig", "precompute_ref_log_probs", "field", (), "refused with humanline", ("DPOTrainer",)),
    Internal("trl.KTOConfig", "precompute_ref_log_probs", "field", (), "refused with humanline", ("KTOTrainer",)),
    Internal("trl.DPOConfig", "sync_ref_model", "field", (), "refused with humanline", ("DPOTrainer",)),
    Internal("trl.KTOConfig", "sync_ref_model", "field", (), "refused with humanline", ("KTOTrainer",)),
    Internal("trl.GRPOConfig", "sync_ref_model", "field", (), "refused with humanline", ("GRPOTrainer",)),
    Internal("trl.GRPOConfig", "use_bias_correction_kl", "field", (), "which KL term GRPO computes",
             ("GRPOTrainer",)),
    Internal("trl.GRPOConfig", "off_policy_mask_threshold", "field", (), "the mask against the synced reference",
             ("GRPOTrainer",)),
    Internal("trl.GRPOConfig", "cast_lm_head_to_fp32", "field", (), "GRPO's reference fused head",
             ("GRPOTrainer",), ">=1.15"),
    # transformers' Trainer: the sync's moment, the row per update, checkpoints and resume
    Internal(T, "training_step", "method", ("model", "inputs"), "adds each micro-batch's loss to the update's row"),
    Internal(T, "log", "method", ("logs",), "TRL's metrics made floats before they are logged"),
    Internal(T, "_save_checkpoint", "method", ("model", "trial"), "writes the humanline files into each checkpoint"),
    Internal(T, "_get_output_dir", "method", ("trial",), "where that checkpoint is"),
    Internal(T, "train", "method", ("resume_from_checkpoint",), "checks a checkpoint before transformers reads it"),
    Internal(T, "create_scheduler", "method", ("num_training_steps",),
             "installs the weights-only DeepSpeed checkpoint engine"),
    Internal(T, "_prepare_for_training", "order",
             ("self.accelerator.prepare(", "self.create_scheduler(", "deepspeed_load_checkpoint("),
             "the weights-only engine is in place before DeepSpeed loads a checkpoint"),
    Internal(T, "model_wrapped", "attribute", (), "the policy the sync copies (a DeepSpeed engine, DDP)"),
    Internal("accelerate.Accelerator", "deepspeed_engine_wrapped", "attribute", (),
             "the engine that gets the weights-only checkpoint engine", deepspeed_only=True),
    Internal(T, "is_deepspeed_enabled", "attribute", (), "whether the sync attaches to the engine's step"),
    Internal("transformers.TrainerCallback", "on_pre_optimizer_step", "method", ("args", "state", "control"),
             "the sync's moment without DeepSpeed"),
    Internal("transformers.trainer_utils", "PREFIX_CHECKPOINT_DIR", "attribute", (), "the checkpoints' folder names"),
    Internal("transformers.trainer_utils", "get_last_checkpoint", "helper", ("folder",),
             "the checkpoint `resume_from_checkpoint=True` names"),
)

RUNTIME_CONTRACTS = (
    ("DPOTrainer._compute_loss, KTOTrainer._compute_loss", "call the policy, then the reference on the same inputs "
     "(the reference's output is the one computed for the policy's call, queued); checked on every call: a "
     "reference called first, or on other inputs, is refused (UnsupportedTrlError)"),
    ("their log-prob functions (trl<1.15)", "the log-prob call after a policy forward takes that forward's logits; "
     "checked on every call"),
)


def uses_fused_head(version: str) -> bool:
    """Whether trl ``version`` takes DPO's and KTO's log-probs from the fused LM head (1.15 on)."""
    return Version(Version(version).base_version) >= Version(FUSED_FROM)


def _trainer_module(trainer: str) -> str:
    return {"DPOTrainer": "trl.trainer.dpo_trainer", "KTOTrainer": "trl.trainer.kto_trainer",
            "GRPOTrainer": "trl.trainer.grpo_trainer"}.get(trainer, "trl.trainer")


def _resolve(path: str):
    """The object at dotted ``path`` (a module, then attributes), or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def _parameters(function) -> Optional[List[str]]:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def _holds(entry: Internal, trainer: str, instance=None) -> bool:
    """Whether ``entry`` holds for ``trainer`` (attributes: on ``instance``, the built trainer; None skips them)."""
    owner = _resolve(entry.owner_path(trainer))
    if owner is None:
        return False
    if entry.kind == "attribute" and inspect.isclass(owner):  # set by the trainer's __init__: read on the instance
        holder = instance if isinstance(instance, owner) else getattr(instance, "accelerator", None)
        return instance is None or hasattr(holder, entry.name)
    if entry.kind == "attribute":
        return hasattr(owner, entry.name)
    if entry.kind == "field":
        return entry.name in getattr(owner, "__dataclass_fields__", {})
    target = getattr(owner, entry.name, None)
    if not callable(target):
        return False
    if entry.kind == "order":
        try:
            source = inspect.getsource(target)
        except (OSError, TypeError):
            return False
        places = [source.find(needle) for needle in entry.needs]
        return all(p >= 0 for p in places) and places == sorted(places)
    params = _parameters(target)
    if params is None:
        return False
    if entry.kind == "method":
        return tuple(params[1:1 + len(entry.needs)]) == entry.needs
    return all(name in params for name in entry.needs)


def missing(trainer: str, version: str, instance=None) -> List[str]:
    """The internals ``trainer``'s humanline subclass needs on trl ``version`` that are absent or changed (each as
    `Internal.label` with its purpose). Without ``instance``, everything but the attributes TRL's ``__init__`` sets;
    with it (the built trainer), those attributes only."""
    deepspeed = bool(getattr(instance, "is_deepspeed_enabled", False))
    return [f"{entry.label(trainer)} ({entry.purpose})" for entry in INTERNALS
            if entry.applies(trainer, version) and on_instance(entry) == (instance is not None)
            and (deepspeed or not entry.deepspeed_only) and not _holds(entry, trainer, instance)]


def on_instance(entry: Internal) -> bool:
    """Whether ``entry`` is an attribute the trainer's ``__init__`` sets (checked on the built trainer)."""
    return entry.kind == "attribute" and inspect.isclass(_resolve(entry.owner_path("DPOTrainer")))


def entries(kinds: Iterable[str] = ("method", "helper", "field", "attribute", "order")) -> List[Internal]:
    return [entry for entry in INTERNALS if entry.kind in tuple(kinds)]


def markdown() -> str:
    """The table as the TRL page shows it: one list per kind, short code spans (nothing wide to break)."""
    titles = {"method": "Methods", "helper": "Functions", "field": "Config fields", "attribute": "Attributes",
              "order": "Order contracts (read from the source at construction)"}
    lines = []
    for kind, title in titles.items():
        lines += [f"**{title}**", ""]
        for entry in entries((kind,)):
            scope = "" if entry.trainers == ALL else f"; {', '.join(t[:-7] for t in entry.trainers)}"
            release = f"; trl{entry.releases}" if entry.releases else ""
            deepspeed = "; under DeepSpeed" if entry.deepspeed_only else ""
            lines.append(f"- {entry.label()}: {entry.purpose}{scope}{release}{deepspeed}")
        lines.append("")
    lines += ["**Checked on every call**", ""]
    lines += [f"- {where}: {what}" for where, what in RUNTIME_CONTRACTS]
    return "\n".join(lines) + "\n"
