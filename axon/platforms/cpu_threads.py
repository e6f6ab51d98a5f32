"""How many intra-op threads the CPU forward runs, and which CPUs they are pinned to.

``omp_threads_bind`` takes vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` values: ``auto`` (one thread per
physical core this process may run on, hyperthread siblings left out), ``nobind``, or a CPU list
such as ``0-3,8``. The threads are pinned by ``torch.ops.axon_cpu.bind_threads`` (needs axon's
kernels; without them nothing is pinned and a warning says so).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8`` -> [0, 1, 2, 3, 8]; a bad list raises ValueError naming the bad part."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(
                f"omp_threads_bind: {part!r} is not a CPU number or range (e.g. 0-3,8)"
            ) from None
        if first < 0 or last < first:
            raise ValueError(f"omp_threads_bind: {part!r} is not an ascending range of CPU numbers")
        cpus += range(first, last + 1)
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"omp_threads_bind: {text!r} names a CPU twice")
    return cpus


def _physical_cores(allowed: list[int]) -> list[int]:
    """The first hyperthread of each core among ``allowed`` (all of them where topology is unknown)."""
    seen: set[str] = set()
    cores = []
    for cpu in allowed:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                siblings = f.read().strip()
        except OSError:
            return allowed
        if siblings not in seen:
            seen.add(siblings)
            cores.append(cpu)
    return cores


def thread_cpus(bind: str | None, num_threads: int | None) -> list[int] | None:
    """The CPUs to pin the intra-op threads to, one each; None: leave them to the OS."""
    bind = bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "auto"
    if bind == "nobind":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if bind in ("auto", "all"):
        cores = _physical_cores(allowed) if bind == "auto" else allowed
        if num_threads is None:
            return cores
        if num_threads > len(allowed):
            raise ValueError(
                f"num_threads={num_threads} is more than the {len(allowed)} CPUs this process may use"
            )
        return (cores + [c for c in allowed if c not in cores])[:num_threads]
    cpus = parse_cpu_list(bind)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ValueError(f"omp_threads_bind: CPU {outside[0]} is not one this process may use ({allowed})")
    if num_threads is not None and num_threads != len(cpus):
        raise ValueError(
            f"num_threads={num_threads} does not match the {len(cpus)} CPUs of omp_threads_bind={bind!r}"
        )
    return cpus


def configure_cpu_threads(cpus: list[int] | None, num_threads: int | None, kernels_loaded: bool) -> None:
    """Set (and pin) the calling thread's intra-op threads; call it on every thread that runs
    forwards (torch's thread pool belongs to the thread that calls into it)."""
    if cpus is None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        return
    if not kernels_loaded:
        logger.warning("threads are not pinned: pinning needs axon's C++ kernels")
        torch.set_num_threads(len(cpus))
        return
    torch.ops.axon_cpu.bind_threads(cpus)


def init_cpu_process(
    device: torch.device, cache_root: str, num_threads: int | None, bind: str | None
) -> tuple[bool, list[int] | None]:
    """For a worker on ``device``: load axon's CPU kernels and set up the calling thread's
    intra-op threads. Returns (kernels loaded, the CPUs the threads are pinned to)."""
    if device.type != "cpu":
        return False, None
    from axon.platforms.cpu_kernels import load_cpu_kernels

    cpus = thread_cpus(bind, num_threads)
    kernels = load_cpu_kernels(cache_root)
    configure_cpu_threads(cpus, num_threads, kernels)
    if cpus is not None:
        logger.info("%d intra-op threads pinned to CPUs %s", len(cpus), cpus)
    return kernels, cpus
