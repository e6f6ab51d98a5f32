"""Request: one sequence inside the engine core, and its status machine.

Progress is one counter: ``num_computed_tokens`` (tokens whose KV is in the cache) catches up
with ``num_tokens`` (prompt + generated). Prefill, segmented prefill, prefix-cache hits and
resumption after preemption all follow from it.

    WAITING_FOR_FSM ──grammar compiled──> WAITING   (structured outputs only)
    WAITING ──admitted, KV to load──> WAITING_FOR_REMOTE_KVS ──loaded/failed──> WAITING
                                                               (disaggregated decode only)
    WAITING ──schedule──> RUNNING ──stop/length/abort──> FINISHED_*
       ^                     │
       └────PREEMPTED <──────┘   (blocks freed, num_computed_tokens = 0, recomputed later)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

from axon.pooling_params import EnginePoolingParams
from axon.sampling_params import EngineSamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # structured output: its grammar is compiling
    WAITING_FOR_REMOTE_KVS = enum.auto()  # holds blocks that a KV connector is loading
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its KV could not be loaded (kv_load_failure_policy "fail")

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}

# Legal moves of the status machine; anything else is a bug.
_TRANSITIONS: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING_FOR_FSM: {RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.WAITING: {
        RequestStatus.RUNNING,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
    },
    RequestStatus.WAITING_FOR_REMOTE_KVS: {
        RequestStatus.WAITING,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    },
    RequestStatus.PREEMPTED: {
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_ABORTED,
        # Async scheduling: preempted while its last token was in flight.
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
    },
    RequestStatus.RUNNING: {
        RequestStatus.PREEMPTED,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
    },
}


class Request:
    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: EngineSamplingParams | None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        pooling_params: EnginePoolingParams | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        images: list[Any] | None = None,
        prompt_embeds: Any = None,
        lora: Any = None,
    ) -> None:
        assert prompt_token_ids, "a request needs at least one prompt token"
        assert (sampling_params is None) != (pooling_params is None), "one of sampling or pooling"
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # A pooling request computes its prompt, is pooled, and finishes: it never samples.
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # Disaggregated serving (vLLM's protocol): do_remote_decode asks this server to keep the
        # prompt's KV for a decode server; do_remote_prefill says where to load it from.
        self.kv_transfer_params = kv_transfer_params
        self.kv_load_failed = False  # a connector's load failed once: never try it again
        self.images = images  # a multimodal prompt's images (messages.ImageInput), for the worker
        self.prompt_embeds = prompt_embeds  # a prompt given as embeddings (inputs.PromptEmbeds)
        self.lora = lora  # its LoRA adapter (lora.request.LoRAInput), None: the base model
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens being sampled by a step in flight, already counted in
        # num_computed_tokens for the step scheduled after it, not known yet.
        self.num_output_placeholders = 0
        # Speculative decoding: tokens the proposer drafted after the last step, verified by the
        # next one (their KV is computed then; rejected ones are rolled back).
        self.spec_token_ids: list[int] = []
        # Prompt tokens found in the prefix cache when first scheduled (vLLM's num_cached_tokens).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.first_scheduled_time = 0.0  # wall clock of the first admission (queue time ends)
        # Chained hashes of this request's full blocks, extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        # Grammar state (axon.structured_output.manager.StructuredOutputRequest), if constrained.
        self.structured_output_request: Any = None
        self._update_block_hashes()

    @property
    def max_tokens(self) -> int:
        if self.sampling_params is None:
            return 0  # a pooling request generates nothing
        return self.sampling_params.max_tokens  # resolved by the input processor

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params is not None and self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def set_status(self, status: RequestStatus) -> None:
        allowed = _TRANSITIONS.get(self.status, set())
        assert status in allowed, (
            f"request {self.req_id}: illegal status change {self.status.name} -> {status.name}"
        )
        self.status = status

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
