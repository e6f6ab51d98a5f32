"""Device facts in one place: which device, which dtype "auto" means, how much memory KV gets."""

from __future__ import annotations

import functools
import math
import mmap
import os

import torch
from torch import nn

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    return torch.device(name)


@functools.cache
def cpu_has_bf16() -> bool:
    """AVX-512 BF16 or AMX: bfloat16 matmuls run natively, so "auto" means bfloat16."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def total_memory_bytes(device: torch.device) -> int:
    """The device's whole memory: a fact of the machine, unlike free memory, which changes from
    one start to the next. On the CPU, physical memory or the cgroup's limit, whichever is less."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return total
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_memory_limit()
    return min(physical, limit) if limit is not None else physical


def _cgroup_memory_limit() -> int | None:
    """cgroup v2 ``memory.max`` (v1: ``memory.limit_in_bytes``); None when unlimited or absent."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def kv_budget_within_share(free: int, total: int, utilization: float) -> int:
    """``utilization * total`` less what is in use (``total - free``); raises if nothing is left."""
    budget = int(utilization * total) - (total - free)
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {utilization * total / gib:.1f} GiB of the "
            f"device's {total / gib:.1f} GiB, but {(total - free) / gib:.1f} GiB are in use already "
            "(this engine's weights, other processes); raise gpu_memory_utilization, free memory, or set "
            "num_gpu_blocks_override"
        )
    return budget


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping backed by transparent huge pages.

    The kernel hands out zero pages on first touch, so nothing is written up front (``torch.zeros``
    of a 4 GiB KV cache took 5.6 s on a 2-core machine) and resident memory grows as it is used.
    Huge pages (``MADV_HUGEPAGE``; where the kernel allows them) cut TLB misses when weights or
    KV blocks stream by: a one-row GEMV over 56 MB of bf16 weights read 35 GB/s from huge pages
    and 23 GB/s from 4 KiB pages on a 2-core EPYC.
    """
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, which gets no huge pages.
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages it is
            pass
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


@torch.no_grad()
def move_to_huge_pages(module: nn.Module) -> None:
    """Copy every CPU parameter and buffer of ``module`` into one huge-page mapping (tied
    tensors stay tied). Weights stream from memory every decode step; see ``huge_page_zeros``."""
    tensors: dict[int, torch.Tensor] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous():
            tensors.setdefault(id(t), t)
    if not tensors:
        return
    align = 64  # bytes: every tensor starts on a cache line
    offsets, total = {}, 0
    for key, t in tensors.items():
        offsets[key] = total
        total += -(-t.numel() * t.element_size() // align) * align
    arena = huge_page_zeros((total,), torch.uint8)
    for key, t in tensors.items():
        start = offsets[key]
        view = arena[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        t.data = view
