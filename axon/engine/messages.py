"""Records that cross from the front end into the engine core (msgspec: process-safe)."""

from __future__ import annotations

import msgspec

from axon.core.outputs import EngineCoreOutput, SchedulerStats
from axon.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None


class EngineCoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None


__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "SchedulerStats"]
