"""The fake world of a rehearsal: this process is one rank of the recipe's world size; every other rank is
hallucinated by torch's fake process group (``torch.testing._internal.distributed.fake_pg``, the tool
torchtitan uses for the same purpose). Its collectives return at once without moving data: an all-reduce
leaves this rank's values, an all-gather copies this rank's piece into every slot, a reduce-scatter keeps
this rank's slice, and a broadcast or a receive leaves the buffer as it was.

Two things here:

* `CollectiveTraffic`: the bytes each collective would move, counted at the process group (every
  ``c10d`` operation goes through the dispatcher, so a dispatch mode sees DeepSpeed's, megatron's and our
  own alike), by kind and by the phase of the update, and the time they would take under a stated
  bandwidth model.
* the one shim on the fake group's semantics: a receive (pipeline sends/recvs) fills its buffer with zeros,
  and the receiving side of a broadcast keeps its own values (as data-parallel ranks are symmetric, they are
  what the root would send: DeepSpeed's ZeRO-3 checks that every rank traced the same modules by a broadcast
  from rank 0) with any non-finite float replaced by zero. The fake group would leave a receive buffer as
  allocated (``torch.empty``: any bits, NaN included), and megatron's pipeline stages allocate them that way; zeros keep
  every value finite, so the trainer's non-finite guard never turns an update into a skipped one (which
  would leave the optimizer step, and its memory, out of the rehearsal). The buffer's shape, the one thing
  the receiving stage needs, is megatron's own.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import RunShape

FAKE_BACKEND = "fake"

# The bandwidth model behind the projected update time (bytes a rank puts on its link / bandwidth, ring
# algorithms, no overlap with compute): NCCL bus bandwidths typical of H100 SXM nodes, within a node over
# NVLink 4 and between nodes over one 400 Gb/s InfiniBand NDR adapter per GPU.
NVLINK_BYTES_PER_S = 360e9
INFINIBAND_BYTES_PER_S = 40e9

# c10d operation -> (kind, the arguments that hold the data it moves, ring factor f(n) on those bytes)
_RING = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
}
COLLECTIVES = {
    "allreduce_": ("all-reduce", ("tensors",)),
    "allreduce_coalesced_": ("all-reduce", ("tensors",)),
    "_allgather_base_": ("all-gather", ("output_tensor",)),
    "allgather_": ("all-gather", ("output_tensors",)),
    "allgather_into_tensor_coalesced_": ("all-gather", ("outputs",)),
    "allgather_coalesced_": ("all-gather", ("output_lists",)),
    "_reduce_scatter_base_": ("reduce-scatter", ("input_tensor",)),
    "reduce_scatter_": ("reduce-scatter", ("input_tensors",)),
    "reduce_scatter_tensor_coalesced_": ("reduce-scatter", ("inputs",)),
    "broadcast_": ("broadcast", ("tensors",)),
    "send": ("pp send", ("tensors",)),
    "recv_": ("pp recv", ("tensors",)),
    "recv_any_source_": ("pp recv", ("tensors",)),
    "alltoall_base_": ("all-to-all", ("input",)),
    "alltoall_": ("all-to-all", ("input_tensors",)),
    "reduce_": ("reduce", ("tensors",)),
    "gather_": ("gather", ("input_tensors",)),
    "scatter_": ("scatter", ("output_tensors",)),
}
FUNCTIONAL = {  # torch's functional collectives (``_c10d_functional``), which name their group
    "all_reduce": ("all-reduce", ("input",)),
    "all_reduce_coalesced": ("all-reduce", ("inputs",)),
    "all_gather_into_tensor": ("all-gather", None),  # output = input x group size
    "reduce_scatter_tensor": ("reduce-scatter", ("input",)),
    "broadcast": ("broadcast", ("input",)),
}
_RECEIVING = {"recv_", "recv_any_source_"}


def join_fake_world(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of ``world_size`` under the fake process group. The engines find the
    group initialised and use it (``hl_core.engines.base.launch_environment`` is never reached). One GPU per
    process: ``LOCAL_RANK`` is 0 whatever the rank."""
    # a private torch module, imported here: importing it registers the "fake" backend, which only a rehearsal needs
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs a process of its own: a process group is already initialised here")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # read by nobody: the fake group has no rendezvous
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)


def skip_cross_rank_checks() -> None:
    """DeepSpeed ZeRO-3 checks, once it has traced a forward and backward, that every rank traced the same
    modules (rank 0 broadcasts its list; the others compare it with theirs). A fake world cannot answer for
    rank 0 (a broadcast moves nothing, and the receivers' buffers hold a sentinel), so in a rehearsal of a rank
    other than 0 the check is skipped: the one place a rehearsal changes an engine's code path. It moves a few
    bytes (the list of module ids), left out of the traffic."""
    # deepspeed: only a ZeRO-3 rehearsal reaches here, and it has imported deepspeed already
    from deepspeed.runtime.zero import partitioned_param_coordinator

    partitioned_param_coordinator.assert_ints_same_as_other_ranks = lambda ints: None


def ranks_to_rehearse(shape: RunShape, world_size: int) -> List[int]:
    """Rank 0 and, under pipeline parallelism, the first rank of the last stage (megatron-core's rank order
    ``tp-cp-ep-dp-pp`` puts the pipeline stage outermost: stage ``s`` holds ranks ``s * world/pp ..``)."""
    ranks = [0]
    if shape.engine.name == "megatron" and shape.parallel.pp > 1:
        ranks.append(world_size - world_size // shape.parallel.pp)
    return ranks


def _tensors(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(tensors: List[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Transfer:
    """One kind of collective in one phase: calls, payload bytes, the bytes on this rank's link (ring
    model), and that time at the bandwidth of the link the group spans."""

    calls: int = 0
    payload: int = 0
    wire: float = 0.0
    seconds: float = 0.0
    between_nodes: bool = False


class CollectiveTraffic:
    """Counts what every collective of this rank would move, by (phase, kind). ``gpus_per_node`` decides
    whether a group's ranks span nodes (InfiniBand) or not (NVLink)."""

    def __init__(self, gpus_per_node: int):
        self.gpus_per_node = max(1, int(gpus_per_node))
        self.phase = "other"
        self.recording = False
        self.table: Dict[Tuple[str, str], Transfer] = defaultdict(Transfer)

    @staticmethod
    def is_collective(func) -> bool:
        return func.namespace == "c10d" or func.namespace == "_c10d_functional"

    def before(self, func, args, kwargs) -> None:
        """Zero a receive buffer (see the module docstring); runs whether or not the traffic is recorded."""
        name = func._schema.name.split("::")[-1]
        if func.namespace != "c10d" or name not in _RECEIVING | {"broadcast_"}:
            return
        named = self._named(func, args, kwargs)
        if name == "broadcast_":
            group = dist.ProcessGroup.unbox(named["process_group"])
            if named["root_rank"] == group.rank():
                return  # the sender keeps its data
        with torch.no_grad():
            for tensor in _tensors(named["tensors"]):
                if name != "broadcast_":
                    tensor.zero_()
                elif tensor.is_floating_point():  # a broadcast keeps this rank's own (symmetric) values, finite
                    tensor.masked_fill_(~torch.isfinite(tensor), 0)

    def after(self, func, args, kwargs) -> None:
        if not self.recording:
            return
        name = func._schema.name.split("::")[-1]
        if func.namespace == "c10d":
            if name not in COLLECTIVES:
                return  # barrier and the like: no data
            kind, fields = COLLECTIVES[name]
            named = self._named(func, args, kwargs)
            group = dist.ProcessGroup.unbox(named["process_group"])
            payload = _nbytes([t for f in fields for t in _tensors(named[f])])
            peer = named.get("dst", named.get("src"))
        else:
            if name not in FUNCTIONAL:
                return
            kind, fields = FUNCTIONAL[name]
            named = self._named(func, args, kwargs)
            group = dist.distributed_c10d._resolve_process_group(named["group_name"])
            payload = (_nbytes(_tensors(named["input"])) * group.size() if fields is None
                       else _nbytes([t for f in fields for t in _tensors(named[f])]))
            peer = None
        ranks = dist.get_process_group_ranks(group)
        if peer is not None:  # a point-to-point transfer spans this rank and its peer only
            ranks = [dist.get_rank(), ranks[peer]]
        between = len({r // self.gpus_per_node for r in ranks}) > 1
        wire = payload * _RING.get(kind, lambda n: 1.0)(max(len(ranks), 1))
        row = self.table[(self.phase, f"{kind} between nodes" if between else kind)]  # one link per row
        row.calls += 1
        row.payload += payload
        row.wire += wire
        row.seconds += wire / (INFINIBAND_BYTES_PER_S if between else NVLINK_BYTES_PER_S)
        row.between_nodes = row.between_nodes or between

    @staticmethod
    def _named(func, args, kwargs) -> Dict[str, object]:
        names = [a.name for a in func._schema.arguments]
        named = dict(zip(names, args))
        named.update(kwargs or {})
        return named

    def by_kind(self, phases: Optional[Tuple[str, ...]] = None) -> Dict[str, Transfer]:
        """The table summed over phases (all, or those named)."""
        out: Dict[str, Transfer] = defaultdict(Transfer)
        for (phase, kind), row in self.table.items():
            if phases is not None and phase not in phases:
                continue
            total = out[kind]
            total.calls += row.calls
            total.payload += row.payload
            total.wire += row.wire
            total.seconds += row.seconds
            total.between_nodes = total.between_nodes or row.between_nodes
        return dict(out)
