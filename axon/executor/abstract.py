"""The interface EngineCore drives its worker(s) through, and the registry of executors.

Every executor runs the same steps in the same order; they differ in where the workers live
(this process, processes on this host, Ray actors). ``execute_model`` returns a future so that
how a step overlaps the caller (async scheduling's step thread, a remote worker's reply) is the
executor's business: EngineCore schedules step N+1 while the future of step N is pending only
when ``max_concurrent_batches > 1``.

Facts only the workers know come back on calls EngineCore makes anyway (no extra round trip to
every worker per step): the bucket a step ran at on its ``ModelRunnerOutput``, compile events
from the call that compiled (``compile_or_warm_up_model``, ``compile_pending``), the model load
time once at start.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from axon.config import EXECUTOR_BACKENDS, AxonConfig
from axon.platforms import resolve_device
from axon.scheduler_output import CompileEvent, ModelRunnerOutput, SchedulerOutput

# distributed_executor_backend -> the executor class, imported only when chosen (a Ray executor
# must not import ray for everyone). Keys: config.EXECUTOR_BACKENDS, which validate_config checks.
_REGISTRY = {
    "uni": "axon.executor.uniproc:UniProcExecutor",
    "mp": "axon.executor.multiproc:MultiprocExecutor",
    "ray": "axon.executor.ray_executor:RayExecutor",
}
assert set(_REGISTRY) == set(EXECUTOR_BACKENDS), "config.EXECUTOR_BACKENDS names the registered executors"


class Executor(ABC):
    """Start-up: ``determine_num_blocks`` -> ``initialize_kv_cache`` -> ``compile_or_warm_up_model``;
    then ``execute_model`` per step (steps run in submission order), ``compile_pending`` when idle,
    ``shutdown`` at the end."""

    @staticmethod
    def get_class(config: AxonConfig) -> type[Executor]:
        p = config.parallel_config
        name = p.distributed_executor_backend or ("uni" if p.tensor_parallel_size == 1 else "mp")
        if name not in _REGISTRY:
            raise ValueError(
                f"distributed_executor_backend {name!r} is not implemented; supported: {', '.join(_REGISTRY)}"
            )
        module, cls = _REGISTRY[name].split(":")
        executor_class = getattr(importlib.import_module(module), cls)
        assert issubclass(executor_class, Executor), f"{executor_class} does not implement Executor"
        return executor_class

    @abstractmethod
    def __init__(self, config: AxonConfig) -> None:
        """Start the worker(s) and load the model."""

    @property
    @abstractmethod
    def max_concurrent_batches(self) -> int:
        """Steps that may be in flight at once: 2 with async scheduling, else 1."""

    @property
    @abstractmethod
    def model_load_time_s(self) -> float:
        """Seconds the (slowest) worker took to load the weights."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers; null block included)."""

    @abstractmethod
    def kv_cache_window(self) -> int | None:
        """The sliding window of the KV cache's window group (``Worker.kv_cache_window``); None: one group."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def compile_or_warm_up_model(self) -> list[CompileEvent]:
        """Compile what the policy compiles at start (bucket_compile=warmup); the compile events."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Run one step. Steps run in the order submitted, so a step reads the tokens the step
        before it sampled. The future raises what the step raised."""

    @abstractmethod
    def compile_pending(self) -> list[CompileEvent]:
        """Idle, nothing in flight: compile the buckets traffic reached; the compile events
        (empty: nothing was pending)."""

    def start_profile(self) -> None:
        """Profile every worker process (an in-process worker is in the engine core's profile)."""

    def stop_profile(self) -> list[str]:
        """The trace files the worker processes wrote."""
        return []

    def sleep(self) -> None:
        """Every worker releases its KV cache's memory (no step in flight)."""
        self._call_workers("sleep")

    def wake_up(self) -> None:
        self._call_workers("wake_up")

    def _call_workers(self, method: str) -> None:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker has failed (called by the idle engine loop; a step's future raises
        on its own)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers; steps still in flight are abandoned."""


class MultiRankExecutor(Executor):
    """An executor of several ranks that every call reaches (``mp``, ``ray``): start-up and
    compile calls go to every rank; the block count is the minimum over ranks, compile events
    are rank 0's (every rank compiles the same buckets at the same time)."""

    _async_scheduling: bool
    _load_time_s: float

    @abstractmethod
    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank (no step in flight); results by rank."""

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self._async_scheduling else 1

    @property
    def model_load_time_s(self) -> float:
        return self._load_time_s

    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks"))

    def kv_cache_window(self) -> int | None:
        return self._call_all("kv_cache_window")[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def compile_or_warm_up_model(self) -> list[CompileEvent]:
        return self._call_all("compile_or_warm_up_model")[0]

    def compile_pending(self) -> list[CompileEvent]:
        return self._call_all("compile_pending")[0]

    def _call_workers(self, method: str) -> None:
        self._call_all(method)

    def start_profile(self) -> None:
        self._call_all("start_profile")

    def stop_profile(self) -> list[str]:
        return [p for p in self._call_all("stop_profile") if p]


class WorkerError(RuntimeError):
    """A worker (rank) raised or died; the message names it and carries its traceback or exit code."""


class LazyFuture(Future):
    """A step's output that a remote rank sends back, read only when the engine asks for it
    (``wait(future)`` reads replies until this future has its result or exception)."""

    def __init__(self, wait: Callable[[LazyFuture], None]) -> None:
        super().__init__()
        self._wait = wait

    def result(self, timeout: float | None = None) -> Any:
        self._wait(self)
        return super().result(timeout)


def resolve_async_scheduling(config: AxonConfig) -> bool:
    """None: on for CUDA, where the CPU is idle while the GPU runs a step; off on the CPU, where
    the forward's threads own every core: the scheduling thread then takes a core from one of
    them mid-step and the whole parallel region waits for it (tiny Llama, batch 16, 2 cores:
    843-857 tok/s async against 1092-1374 sync)."""
    value = config.scheduler_config.async_scheduling
    if value is None:
        return resolve_device(config.device_config.device).type == "cuda"
    return value
