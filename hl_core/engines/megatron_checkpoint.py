"""Megatron checkpoints: resumable per-(pp, tp)-shard save/load, and the Hugging Face export.

``MegatronCheckpointing`` is a mixin of ``MegatronEngine``; it reads the engine's layout (``rank``,
``world_size``, ``tp``/``pp`` and their ranks, ``dp_rank``, ``cpu``), its models (``policy_module``,
``reference``), ``optimizer``, ``dtype``, ``hf_config``, ``te``, ``tokenizer`` and its counters
(``updates_done``, ``_micro_steps``).

Layout of ``<directory>/<tag>/``: ``mp_rank_pp<P>_tp<T>.pt`` per model-parallel shard (policy, reference
when syncing, optimizer state, counters; written by data-parallel rank 0), ``optim_pp<P>_tp<T>.pt`` (GPU:
the distributed optimizer's parameter state), ``client_state.pt`` and ``megatron_layout.json`` (rank 0);
the trainer then marks it complete and writes ``<directory>/latest`` (``hl_core/storage/checkpoints.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ..errors import RecipeError
from ..storage.checkpoints import check_files, read_megatron_layout, safe_load, wrote_lookahead
from .megatron_convert import mcore_to_hf, save_hf_directory

LAYOUT_FILE = "megatron_layout.json"


class MegatronCheckpointing:
    """Checkpoint save/load and ``save_hf`` for ``MegatronEngine`` (see the module docstring)."""

    @torch.no_grad()
    def _copy_shard(self, model, shard: Dict[str, torch.Tensor]) -> None:
        params = dict(model.named_parameters())
        if set(params) != set(shard):
            raise RecipeError(
                "The converted checkpoint does not match the megatron-core model "
                f"(only in model: {sorted(set(params) - set(shard))[:5]}, only in checkpoint: "
                f"{sorted(set(shard) - set(params))[:5]})."
            )
        for name, param in params.items():
            if tuple(param.shape) != tuple(shard[name].shape):
                raise RecipeError(f"Shape mismatch for `{name}`: model {tuple(param.shape)}, checkpoint "
                                  f"{tuple(shard[name].shape)}.")
            param.copy_(shard[name].to(param.dtype))

    def _shard_file(self, directory: Path) -> Path:
        return directory / f"mp_rank_pp{self.pp_rank:03d}_tp{self.tp_rank:02d}.pt"

    def _optimizer_file(self, directory: Path) -> Path:
        return directory / f"optim_pp{self.pp_rank:03d}_tp{self.tp_rank:02d}.pt"

    def _local_state(self, module) -> Dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}

    def save(self, directory: str, tag: str, client_state: Dict[str, Any]) -> None:
        """Per (pp, tp) shard: policy, reference (when syncing) and optimizer state, written by data-parallel
        rank 0 (the CPU optimizer is replicated over data parallel; the GPU distributed optimizer's
        parameter state is gathered over data parallel by megatron-core's ``save_parameter_state``).
        Rank 0 writes the client state and the layout."""
        path = Path(directory) / tag
        # every rank enters before anything is written: the trainer looks for an existing tag directory
        # on each rank to decide whether to save, so creating it early would race with that check
        self.barrier()
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        if self.dp_rank == 0:
            state = {"policy": self._local_state(self.policy_module), "updates_done": self.updates_done,
                     "micro_steps": self._micro_steps}
            if self.has_reference and self.recipe.humanline.sync_every is not None:
                state["reference"] = self._local_state(self.reference)
            state["optimizer"] = self.optimizer.state_dict()  # GPU: the non-parameter part (steps, groups)
            torch.save(state, self._shard_file(path))
        if not self.cpu:  # the distributed optimizer's parameter state, gathered to data-parallel rank 0
            self.optimizer.save_parameter_state(str(self._optimizer_file(path)))
        if self.rank == 0:
            torch.save(client_state, path / "client_state.pt")
            (path / LAYOUT_FILE).write_text(json.dumps({"tp": self.tp, "pp": self.pp, "world_size": self.world_size}))
        self.barrier()

    def load(self, directory: str, tag: Optional[str] = None) -> Dict[str, Any]:
        if tag is None:
            tag = (Path(directory) / "latest").read_text().strip()
        path = Path(directory) / tag
        check_files(path)  # every rank refuses a bad file alike before any loads
        layout_file = path / LAYOUT_FILE
        if not layout_file.exists():
            raise RecipeError(f"No megatron checkpoint found in `{path}`. Fix: check `checkpoint.resume`.")
        layout = read_megatron_layout(layout_file)
        if ((layout["tp"], layout["pp"]) != (self.tp, self.pp)
                or (not self.cpu and layout["world_size"] != self.world_size)):
            raise RecipeError(
                f"Checkpoint `{path}` was written with tp={layout['tp']}, pp={layout['pp']} "
                f"({layout['world_size']} processes); this run has tp={self.tp}, pp={self.pp} ({self.world_size}). "
                "Fix: resume with the same `parallel` layout, or export with save_hf and start a new run from it."
            )
        state = safe_load(self._shard_file(path))
        self._copy_shard(self.policy_module, state["policy"])
        if self.has_reference and self.recipe.humanline.sync_every is not None:
            if "reference" not in state and wrote_lookahead(path):
                self._sync_pairs.sync()  # a look-ahead checkpoint keeps no copy: start one from the policy
                self.resynced_at_resume = True
            elif "reference" not in state:
                raise RecipeError(
                    f"Checkpoint `{path}` has no reference shard, but this run syncs the reference. "
                    "Fix: resume from a checkpoint written by a syncing run."
                )
            else:
                self._copy_shard(self.reference, state["reference"])
        self.updates_done = int(state["updates_done"])
        self._micro_steps = int(state["micro_steps"])
        self.optimizer.load_state_dict(state["optimizer"])
        if not self.cpu:
            self.optimizer.load_parameter_state(str(self._optimizer_file(path)))
        return safe_load(path / "client_state.pt") or {}

    def save_hf(self, directory: str) -> None:
        """Gather every (pp, tp) policy shard to rank 0 (data-parallel rank 0 ranks send), merge, write."""
        local = self._local_state(self.policy_module) if self.dp_rank == 0 else None
        if self.dtype != torch.float32 and local is not None:
            local = {k: v.to(self.dtype) for k, v in local.items()}
        item = ((self.pp_rank, self.tp_rank), local)
        gathered = [None] * self.world_size if self.rank == 0 else None
        torch.distributed.gather_object(item, gathered, dst=0)
        if self.rank == 0:
            shards = {key: sd for key, sd in gathered if sd is not None}
            hf = mcore_to_hf(shards, self.hf_config, self.tp, self.pp, te=self.te)
            save_hf_directory(hf, self.hf_config, directory, self.tokenizer)
        self.barrier()


def _resolve_weights_dir(name_or_path: str) -> str:
    if Path(name_or_path).is_dir():
        return name_or_path
    from huggingface_hub import (
        snapshot_download,  # imported here: only a hub name needs it
    )

    return snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"])
