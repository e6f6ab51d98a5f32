"""This process's tensor-parallel group, and the collectives the sharded layers call.

A worker joins its group (``init_tensor_parallel``) before it builds the model: the layers read
``get_tp_group()`` while they are built, to take their share of heads, of the MLP's width and
of the vocabulary (axon/model/layers/tensor_parallel.py). With one rank (every ``uni``
executor) the group is the default one, rank 0 of 1, and the collectives return their input.

On the CPU the collectives go through a shared-memory segment (``axon/csrc/cpu_comm.cpp``):
every rank of a group runs on this host, and gloo's all-reduce over loopback TCP cost 1.4 ms
per call there. torch.distributed (gloo on the CPU, NCCL on CUDA) carries the rest: the
collectives on CUDA, and on the CPU where axon's kernels could not be built.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A rank waits this long for the others in a torch.distributed collective before it fails (the
# executor notices a dead rank within a second and ends the engine long before).
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    shm_handle: int | None = None  # the shared-memory communicator of axon's CPU kernels
    # Decode context parallelism: consecutive runs of dcp_size ranks (which hold the same KV
    # heads) each shard a sequence's K/V by position (decode_context_parallel_size).
    dcp_size: int = 1
    # Attention data parallelism: every rank holds the whole attention layer and attends its own
    # requests; the rest of the model is split as usual (attention_dp_size).
    attention_dp: bool = False

    @property
    def dcp_rank(self) -> int:
        """This rank's place in its decode-context-parallel group."""
        return self.rank % self.dcp_size

    @property
    def dcp_first(self) -> int:
        """The tensor-parallel rank of its group's first member."""
        return self.rank - self.dcp_rank


@dataclass(frozen=True)
class DistributedInit:
    """How a worker joins its group: what the executor hands each rank."""

    rank: int
    size: int
    init_method: str  # torch.distributed's rendezvous, e.g. tcp://127.0.0.1:PORT
    shm_path: str | None = None  # the CPU communicator's segment, created by the executor
    shm_slot_bytes: int = 0
    # This rank among the group's ranks on its own host (they share its CPUs); None: rank and
    # size, every rank on one host.
    local_rank: int | None = None
    local_size: int | None = None


_group = TensorParallelGroup()
_expert_parallel = False


def get_tp_group() -> TensorParallelGroup:
    return _group


def set_expert_parallel(enabled: bool) -> None:
    """Whether MoE layers built from now on split their experts across the group's ranks
    (``enable_expert_parallel``) rather than each expert's width."""
    global _expert_parallel
    _expert_parallel = enabled


def expert_parallel() -> bool:
    return _expert_parallel


def init_tensor_parallel(
    init: DistributedInit,
    device: torch.device,
    cpu_kernels: bool,
    dcp_size: int = 1,
    attention_dp: bool = False,
) -> TensorParallelGroup:
    """Join the group described by ``init``; on the CPU with axon's kernels, map the shared
    segment too. ``dcp_size``: decode_context_parallel_size (it divides the group's size);
    ``attention_dp``: attention_dp_size is the group's size."""
    assert init.size % dcp_size == 0, f"decode_context_parallel_size {dcp_size} does not divide {init.size}"
    global _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    if init.size > 1:
        dist.init_process_group(
            backend,
            init_method=init.init_method,
            rank=init.rank,
            world_size=init.size,
            timeout=_COLLECTIVE_TIMEOUT,
        )
    handle = None
    # AXON_CPU_SHM_COLLECTIVES=0 keeps the CPU collectives on gloo (to compare, or to test the
    # path CUDA and kernel-less CPUs take).
    shm = os.environ.get("AXON_CPU_SHM_COLLECTIVES", "1") != "0"
    if shm and init.size > 1 and device.type == "cpu" and cpu_kernels and init.shm_path is not None:
        handle = torch.ops.axon_cpu.shm_comm_open(init.shm_path, init.rank, init.size, init.shm_slot_bytes)
    _group = TensorParallelGroup(init.rank, init.size, handle, dcp_size, attention_dp and init.size > 1)
    how = "shared memory" if handle is not None else backend
    dcp = f", decode-context-parallel rank {_group.dcp_rank} of {dcp_size}" if dcp_size > 1 else ""
    dcp += ", attention data-parallel (whole attention, own requests)" if _group.attention_dp else ""
    logger.info("tensor-parallel rank %d of %d%s (collectives: %s)", init.rank, init.size, dcp, how)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()


# A slot of the CPU communicator's segment: a bigger tensor goes through in chunks.
SHM_SLOT_BYTES = 4 << 20


def shm_segment_bytes(world: int, slot_bytes: int) -> int:
    """The size of the CPU communicator's segment (flags and two buffers of one slot per rank)."""
    flags = world * 64
    return flags + 2 * world * slot_bytes


def create_shm_segment(world: int, name: str) -> str:
    """A zero-filled segment for ``world`` ranks of ``SHM_SLOT_BYTES`` slots at
    /dev/shm/axon-<name>-<random>; its path. The creator removes it once every rank mapped it."""
    path = f"/dev/shm/axon-{name}-{uuid.uuid4().hex[:12]}"
    with open(path, "wb") as f:
        f.truncate(shm_segment_bytes(world, SHM_SLOT_BYTES))
    return path


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks (``x`` itself with one rank)."""
    group = _group
    if group.size == 1:
        return x
    if group.shm_handle is not None and x.device.type == "cpu":
        return torch.ops.axon_cpu.shm_all_reduce(x, group.shm_handle)
    return torch.ops.axon.tp_all_reduce(x)


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` stacked: [size, *x.shape]."""
    group = _group
    if group.size == 1:
        return x.unsqueeze(0)
    if group.shm_handle is not None and x.device.type == "cpu":
        return torch.ops.axon_cpu.shm_all_gather(x, group.shm_handle, group.size)
    return torch.ops.axon.tp_all_gather(x, group.size)


# torch.distributed's collectives as ops a compiled graph calls as one opaque node.
@torch.library.custom_op("axon::tp_all_reduce", mutates_args=())
def _dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


@_dist_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("axon::tp_all_gather", mutates_args=())
def _dist_all_gather(x: torch.Tensor, world: int) -> torch.Tensor:
    out = x.new_empty(world * x.numel())  # gloo wants the ranks' tensors end to end, flat
    dist.all_gather_into_tensor(out, x.contiguous().view(-1))
    return out.view(world, *x.shape)


@_dist_all_gather.register_fake
def _(x: torch.Tensor, world: int) -> torch.Tensor:
    return x.new_empty(world, *x.shape)
