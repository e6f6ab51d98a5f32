"""Records that cross from the front end into the engine core (msgspec: process-safe)."""

from __future__ import annotations

import msgspec

from axon.step_outputs import EngineCoreOutput, SchedulerStats
from axon.sampling_params import EngineSamplingParams


class EngineCoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One sample of one request, validated and resolved by the InputProcessor.

    Everything in it is a msgspec Struct or a plain value: decoding in the engine-core process
    re-derives nothing (tests/engine/test_wire.py checks every record's round trip).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None


class EngineCoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None


__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "SchedulerStats"]
