"""The Ray executor (``ray``): one Ray actor per tensor-parallel rank, placed by a placement
group, so the ranks may run on several hosts of a Ray cluster (vLLM's multi-node setup).

The engine joins the cluster named by ``RAY_ADDRESS`` (``ray start --head`` on one host,
``ray start --address=HEAD:6379`` on the others), or starts a local Ray instance when there is
none. A placement group reserves one bundle of ``_CPUS_PER_RANK`` CPUs per rank (PACK: ranks
share a host where they fit); start-up fails with a clear error when the cluster cannot hold
them. Each actor builds a ``Worker``; the ranks join one torch.distributed group (gloo, or NCCL
on CUDA) at rank 0's address, and ranks that all share one host map a shared-memory segment
for the CPU all-reduce, as under ``mp``.

Calls go to every actor; a step's output is rank 0's, read when the engine asks for it (async
scheduling can queue the next step behind it). An actor that raises or dies fails the step
with its error; a watcher thread notices a dead actor while the engine is idle. Actors die with
the engine (Ray ends the actors of an owner that is gone).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections import deque
from concurrent.futures import Future
from typing import Any

from axon.config import AxonConfig
from axon.distributed.parallel_state import SHM_SLOT_BYTES, DistributedInit, create_shm_segment
from axon.executor.abstract import LazyFuture, MultiRankExecutor, WorkerError, resolve_async_scheduling
from axon.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_CPUS_PER_RANK = 1
_PLACEMENT_TIMEOUT_S = 60.0
_POLL_S = 0.2
_WATCH_INTERVAL_S = 1.0


class RankActor:
    """One rank in a Ray worker process (wrapped by ``ray.remote`` in the executor)."""

    def __init__(self, config: AxonConfig) -> None:
        self.config = config
        self.worker: Any = None

    def host(self) -> tuple[str, int]:
        """This actor's host IP and a TCP port free on it (rank 0's are the group's rendezvous)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def make_segment(self, world: int) -> str:
        """Create the shared-memory segment of the CPU all-reduce on this host (rank 0)."""
        return create_shm_segment(world, "tp-ray")

    def start(self, dist_init: DistributedInit) -> float:
        from axon.startup import configure_logging
        from axon.worker.worker import Worker

        configure_logging(f"worker-{dist_init.rank}")
        self.worker = Worker(self.config, dist_init)
        return self.worker.model_load_time_s

    def remove_segment(self, path: str) -> None:
        if os.path.exists(path):
            os.remove(path)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def step(self, scheduler_output: SchedulerOutput, reply: bool) -> ModelRunnerOutput | None:
        output = self.worker.execute_model(scheduler_output)
        return output if reply else None  # every rank has the output; only rank 0's travels

    def ping(self) -> bool:
        return True


class RayExecutor(MultiRankExecutor):
    def __init__(self, config: AxonConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world = config.parallel_config.tensor_parallel_size
        self._async_scheduling = resolve_async_scheduling(config)
        self._pending: deque[tuple[LazyFuture, list[Any]]] = deque()
        self._failure: str | None = None
        self._stopped = threading.Event()
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            # RAY_ADDRESS names a running cluster; without it Ray starts one for this engine.
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
        bundles = [{"CPU": _CPUS_PER_RANK} for _ in range(self.world)]
        self._group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self._group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            resources = ray.cluster_resources()
            ray.util.remove_placement_group(self._group)
            raise WorkerError(
                f"the Ray cluster cannot place {self.world} ranks of {_CPUS_PER_RANK} CPU each within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s (it has {resources.get('CPU', 0):g} CPUs): add hosts with "
                "`ray start --address=...` or lower tensor_parallel_size"
            )
        actor_class = ray.remote(num_cpus=_CPUS_PER_RANK)(RankActor)
        self._actors = [
            actor_class.options(
                name=f"axon-rank-{rank}-{uuid.uuid4().hex[:6]}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank
                ),
            ).remote(config)
            for rank in range(self.world)
        ]
        try:
            self._load_time_s = self._start_ranks()
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._watch, name="axon-ray-watch", daemon=True).start()

    def _start_ranks(self) -> float:
        import ray

        hosts = self._get([a.host.remote() for a in self._actors])
        ip0, port0 = hosts[0]
        one_host = len({ip for ip, _ in hosts}) == 1
        shm_path = self._get([self._actors[0].make_segment.remote(self.world)])[0] if one_host else None
        local: dict[str, int] = {}
        inits = []
        for rank, (ip, _) in enumerate(hosts):
            local_rank = local.setdefault(ip, 0)
            local[ip] += 1
            inits.append((rank, ip, local_rank))
        refs = [
            actor.start.remote(
                DistributedInit(
                    rank,
                    self.world,
                    f"tcp://{ip0}:{port0}",
                    shm_path,
                    SHM_SLOT_BYTES,
                    local_rank=local_rank,
                    local_size=local[ip],
                )
            )
            for actor, (rank, ip, local_rank) in zip(self._actors, inits, strict=True)
        ]
        load_times = self._get(refs)
        if shm_path is not None:  # every rank has it mapped
            ray.get(self._actors[0].remove_segment.remote(shm_path))
        logger.info(
            "%d Ray actors ready on %s (collectives: %s)",
            self.world,
            sorted(local),
            "shared memory" if shm_path else "torch.distributed",
        )
        return max(load_times)

    # ---- the Executor interface (the rest: MultiRankExecutor) ----------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        self.check_health()
        refs = [actor.step.remote(scheduler_output, rank == 0) for rank, actor in enumerate(self._actors)]
        future: LazyFuture = LazyFuture(self._wait_for)
        self._pending.append((future, refs))
        return future

    def check_health(self) -> None:
        if self._failure is not None:
            raise WorkerError(self._failure)

    def shutdown(self) -> None:
        import ray

        if self._stopped.is_set():
            return
        self._stopped.set()
        for actor in getattr(self, "_actors", []):
            ray.kill(actor)
        ray.util.remove_placement_group(self._group)
        if self._started_ray:
            ray.shutdown()

    # ---- replies ---------------------------------------------------------------------------
    def _call_all(self, method: str, *args: Any) -> list[Any]:
        assert not self._pending, f"{method} called with a step in flight"
        self.check_health()
        return self._get([actor.call.remote(method, *args) for actor in self._actors])

    def _get(self, refs: list[Any]) -> list[Any]:
        """Every rank's result in rank order; the first rank to fail (raise or die) raises
        WorkerError naming it, without waiting for ranks stuck in a collective with it."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    self._failure = self._failure or f"worker rank {rank_of[ref]} failed:\n{e}"
                    raise WorkerError(self._failure) from e
            self.check_health()
        return ray.get(refs)

    def _wait_for(self, future: LazyFuture) -> None:
        while not future.done():
            pending, refs = self._pending.popleft()
            try:
                pending.set_result(self._get(refs)[0])
            except WorkerError as e:
                pending.set_exception(e)
                while self._pending:
                    self._pending.popleft()[0].set_exception(e)

    def _watch(self) -> None:
        """A dead actor while the engine is idle: pings queue behind steps, so only death (not a
        long step) makes one fail."""
        import ray

        while not self._stopped.wait(_WATCH_INTERVAL_S):
            for rank, actor in enumerate(self._actors):
                try:
                    ray.get(actor.ping.remote())
                except Exception as e:  # noqa: BLE001
                    if not self._stopped.is_set():
                        self._failure = self._failure or f"worker rank {rank} (Ray actor) died: {e}"
                        logger.error("%s; the engine stops", self._failure)
                    return
