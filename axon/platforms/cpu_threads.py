"""How many intra-op threads the CPU forward runs, and which CPUs they are pinned to.

``omp_threads_bind`` takes vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` values: ``auto`` (one thread per
physical core this process may run on, hyperthread siblings left out), ``nobind``, or a CPU list
such as ``0-3,8``. The threads are pinned by ``torch.ops.axon_cpu.bind_threads`` (needs axon's
kernels; without them nothing is pinned and a warning says so).

Several ranks on one host (tensor or data parallelism) each take their own CPUs: a list of
groups separated by ``|`` (``0-3|4-7``, vLLM's syntax) gives rank i the i-th group, and ``auto``
or ``all`` split the CPUs into equal consecutive shares, one per rank.
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


def thread_cpus(bind: str | None, num_threads: int | None, rank: int = 0, world: int = 1) -> list[int] | None:
    """The CPUs to pin rank ``rank`` of ``world`` ranks on this host to, one thread each; None:
    leave them to the OS."""
    bind = bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "auto"
    if bind == "nobind":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if bind in ("auto", "all"):
        cores = _physical_cores(allowed) if bind == "auto" else allowed
        if world > 1:
            share = len(cores) // world
            if share == 0:
                raise ValueError(
                    f"{world} ranks need at least one CPU each; this process may use {len(cores)} "
                    f"({'physical cores' if bind == 'auto' else 'CPUs'}): lower the parallel sizes "
                    "or set omp_threads_bind to groups such as 0|1"
                )
            cores = cores[rank * share : (rank + 1) * share]
            allowed = cores
        if num_threads is None:
            return cores
        if num_threads > len(allowed):
            raise ValueError(
                f"num_threads={num_threads} is more than the {len(allowed)} CPUs this rank may use"
            )
        return (cores + [c for c in allowed if c not in cores])[:num_threads]
    groups = bind.split("|")
    if len(groups) != world and not (len(groups) == 1 and world == 1):
        raise ValueError(
            f"omp_threads_bind {bind!r} has {len(groups)} CPU groups for {world} ranks on this host "
            "(one group per rank, separated by |, e.g. 0-3|4-7)"
        )
    cpus = parse_cpu_list(groups[rank])
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ValueError(f"omp_threads_bind: CPU {outside[0]} is not one this process may use ({allowed})")
    if world > 1:
        taken = [c for i, group in enumerate(groups) if i != rank for c in parse_cpu_list(group)]
        shared = sorted(set(taken) & set(cpus))
        if shared:
            raise ValueError(f"omp_threads_bind {bind!r}: CPU {shared[0]} is in two ranks' groups")
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
    device: torch.device,
    cache_root: str,
    num_threads: int | None,
    bind: str | None,
    rank: int = 0,
    world: int = 1,
) -> tuple[bool, list[int] | None]:
    """For a worker on ``device`` (rank ``rank`` of ``world`` on this host): load axon's CPU
    kernels and set up the calling thread's intra-op threads. Returns (kernels loaded, the CPUs
    the threads are pinned to)."""
    if device.type != "cpu":
        return False, None
    from axon.platforms.cpu_kernels import load_cpu_kernels

    cpus = thread_cpus(bind, num_threads, rank, world)
    if cpus is not None and world > 1:
        # One of several ranks on this host: the calling thread too stays on the rank's CPUs
        # (configure_cpu_threads leaves it where it is), or it would run on another rank's.
        os.sched_setaffinity(0, cpus)
    kernels = load_cpu_kernels(cache_root)
    configure_cpu_threads(cpus, num_threads, kernels)
    if cpus is not None:
        logger.info("%d intra-op threads pinned to CPUs %s", len(cpus), cpus)
    return kernels, cpus
