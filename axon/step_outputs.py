"""What the engine core reports per request per step (msgspec: it crosses process boundaries)."""

from __future__ import annotations

from typing import Any

import msgspec

from axon.scheduler_output import BucketStep, CompileEvent, LogprobsLists


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float = 0.0
    # A pooling request's vector, sent once with its finish (finish_reason "stop").
    pooled: list[float] | None = None
    # Disaggregated serving: where a decode server loads this request's KV from (sent once,
    # with its finish, by a prefill server).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct):
    """Verified drafts since the last report (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications (one per request and step with drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at position i was accepted.
    num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self._positions(num_drafts)
        for i in range(num_accepted):
            per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Fold in a later report's counts (the front end sums the core's reports)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self._positions(len(other.num_accepted_tokens_per_pos))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[i] += n

    def _positions(self, num_positions: int) -> list[int]:
        """The per-position counts, at least ``num_positions`` long (the draft length varies)."""
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_positions:
            per_pos.extend([0] * (num_positions - len(per_pos)))
        return per_pos

    def take(self) -> SpecDecodingStats:
        """These counts, and start counting afresh."""
        out = SpecDecodingStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_accepted_tokens_per_pos
        )
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = []
        return out


class KVTransferStats(msgspec.Struct):
    """KV connector transfers since the last report (they reach the front end's metrics)."""

    num_failed_transfers: int = 0
    num_expired: int = 0  # producer: requests whose blocks nobody read in time
    seconds: list[float] = []  # one duration per finished transfer
    bytes_per_transfer: list[int] = []  # aligned with seconds

    def observe(self, num_bytes: int, seconds: float) -> None:
        self.seconds.append(seconds)
        self.bytes_per_transfer.append(num_bytes)

    def add(self, other: KVTransferStats) -> None:
        self.num_failed_transfers += other.num_failed_transfers
        self.num_expired += other.num_expired
        self.seconds.extend(other.seconds)
        self.bytes_per_transfer.extend(other.bytes_per_transfer)

    def take(self) -> KVTransferStats | None:
        """These counts (None if nothing happened), and start counting afresh."""
        if not (self.seconds or self.num_failed_transfers or self.num_expired):
            return None
        out = KVTransferStats(
            self.num_failed_transfers, self.num_expired, self.seconds, self.bytes_per_transfer
        )
        self.num_failed_transfers = self.num_expired = 0
        self.seconds, self.bytes_per_transfer = [], []
        return out


class SchedulerStats(msgspec.Struct):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    spec_decoding: SpecDecodingStats | None = None  # None: speculation is off
    # Execution (filled by the engine core from the worker): this step's bucket, the buckets
    # whose compilation finished since the last report, and start-up times (first report).
    bucket: BucketStep | None = None
    compiles: list[CompileEvent] = []
    model_load_time_s: float | None = None
    startup_time_s: float | None = None
    kv_transfer: KVTransferStats | None = None  # KV connector transfers since the last report
    # LoRA: the adapters of the running and the waiting requests, by name (None: LoRA is off).
    running_lora_adapters: list[str] | None = None
    waiting_lora_adapters: list[str] | None = None
