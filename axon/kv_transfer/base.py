"""The KV connector interface: how one server hands a request's KV blocks to another.

Disaggregated serving splits a request over two servers: a prefill server (``kv_producer``)
computes the prompt and keeps its blocks; a decode server (``kv_consumer``) loads those blocks
into its own cache and generates. A connector is the piece of each server that moves the
blocks. It has vLLM's two halves, with vLLM's method names:

* the **scheduler half** (engine-core process) decides which requests load or send, and when
  a finished request's blocks may be freed::

      get_num_new_matched_tokens  how many prompt tokens another server has for this request
      update_state_after_alloc    the blocks the scheduler gave them (where they are loaded)
      build_connector_meta        this step's work for the worker half (crosses to the worker)
      update_connector_output     what the worker half finished (loads, sends)
      request_finished            whether to keep a finished request's blocks for a remote
                                  reader, and the ``kv_transfer_params`` that tell it where

* the **worker half** (beside the KV cache tensors) moves bytes::

      register_kv_caches          the cache tensors, once
      bind_connector_metadata     this step's work, before the forward
      start_load_kv               start loading (asynchronously: a load never blocks a step)
      wait_for_save               after the forward: save what this step finished computing
                                  (axon's per-step form of vLLM's save_kv_layer + wait_for_save)
      progress                    a step without a forward: drive the transfers a moment
      get_finished                the requests whose loads and sends are done

A request that loads KV waits in ``WAITING_FOR_REMOTE_KVS`` holding its blocks (the scheduler
never runs it meanwhile) and runs once ``get_finished`` reports it; a failed load is reported
too (``failed_recving``), and the scheduler then recomputes the prompt or fails the request
(``kv_load_failure_policy``). Loads are always asynchronous in axon: ``get_num_new_matched_tokens``
answers ``(n, True)`` or ``(0, False)``.

Two connectors implement it: ``NixlConnector`` (the decode side pulls the blocks by index from
the prefill side's registered memory with NIXL, vLLM's protocol) and ``SharedStorageConnector``
(the prefill side pushes each finished prompt's blocks into files, keyed by the prompt's tokens;
any decode server on the host finds them by content).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from axon.kv_transfer.config import KVTransferSettings
from axon.step_outputs import KVTransferStats


class KVConnectorMetadata:
    """One step's work for the worker half (each connector subclasses it; pickled to workers)."""


@dataclass
class KVConnectorOutput:
    """What the worker half finished since its last report."""

    # Producer: requests whose blocks the remote side has read (or whose wait timed out): free them.
    finished_sending: set[str] = field(default_factory=set)
    # Consumer: requests whose load ended, successfully or not.
    finished_recving: set[str] = field(default_factory=set)
    # Of finished_recving, the loads that failed (the blocks hold nothing usable).
    failed_recving: set[str] = field(default_factory=set)
    stats: KVTransferStats | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.stats)


class KVConnectorScheduler(abc.ABC):
    """The scheduler half. ``request`` is the engine core's Request (``req_id``,
    ``prompt_token_ids``, ``num_tokens``, ``kv_transfer_params``, ``get_finish_reason()``)."""

    def __init__(self, settings: KVTransferSettings, block_size: int, engine_index: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.engine_index = engine_index  # the data-parallel rank: ports are offset by it
        # A request's block ids, in token order (the scheduler binds its KV cache manager's).
        self.block_ids_of: Callable[[str], list[int]] = lambda req_id: []

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens past ``num_computed_tokens`` (the local prefix-cache hit) that this
        connector can load, and whether the load is asynchronous. Never the whole prompt: the
        last prompt token is computed here, for its logits."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's blocks now cover the loaded tokens (``block_ids``: all of its blocks)."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's work for the worker half, at the end of ``schedule()`` (the step's
        SchedulerOutput: what runs); resets what it gathered since the last step."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker half reported this step (default: nothing to track)."""

    @abc.abstractmethod
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request ended: (keep its blocks until the worker half reports it sent,
        kv_transfer_params for the client, which passes them to the decode server)."""

    def shutdown(self) -> None:
        """Release what the half holds."""


class KVConnectorWorker(abc.ABC):
    """The worker half: it sees the cache tensors, one (K, V) pair per attention layer, each
    [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, settings: KVTransferSettings, block_size: int, engine_index: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.engine_index = engine_index
        self.metadata: KVConnectorMetadata | None = None
        self.stats = KVTransferStats()
        # What computed the cache (model, weights' quantization, dtypes), set before
        # register_kv_caches: KV is only ever loaded from a server with the same identity.
        self.model_identity = ""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self.metadata = metadata

    def clear_connector_metadata(self) -> None:
        self.metadata = None

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Start the loads of the bound metadata (they finish in a later ``get_finished``)."""

    def wait_for_save(self) -> None:
        """After the step's forward: save what the bound metadata asks to save."""

    def progress(self, budget_s: float) -> None:
        """A step with no forward (the engine only waits on transfers): drive the transfers for
        up to ``budget_s`` seconds, returning early once one ends (default: nothing to drive)."""

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Poll the transfers. ``finished_req_ids``: requests the scheduler ended since the last
        step (a connector drops their state)."""

    def shutdown(self) -> None:
        """Release what the half holds (memory registrations, sockets, threads)."""


def block_regions(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Every cache tensor (K and V of each layer, in order), each viewed as [num_blocks, bytes
    of one block]: a block of a region is one contiguous run of bytes."""
    regions = []
    for k, v in kv_caches:
        for t in (k, v):
            assert t.is_contiguous(), "KV cache tensors are contiguous"
            regions.append(t.view(torch.uint8).view(t.shape[0], -1))
    return regions
