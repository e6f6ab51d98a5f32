"""Records that cross from the front end into the engine core (msgspec: process-safe)."""

from __future__ import annotations

from typing import Any

import msgspec

from axon.lora.request import LoRAInput
from axon.multimodal.inputs import ImageInput, PromptEmbeds
from axon.pooling_params import EnginePoolingParams
from axon.sampling_params import EngineSamplingParams
from axon.step_outputs import EngineCoreOutput, SchedulerStats


class EngineCoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One sample of one request, validated and resolved by the InputProcessor.

    Exactly one of ``sampling_params`` (generation) and ``pooling_params`` (an embedding: the
    prompt is computed, pooled, and the request ends) is set.

    Everything in it is a msgspec Struct or a plain value: decoding in the engine-core process
    re-derives nothing (tests/engine/test_wire.py checks every record's round trip).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams | None
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None
    pooling_params: EnginePoolingParams | None = None
    # Disaggregated serving (vLLM's SamplingParams.extra_args["kv_transfer_params"]).
    kv_transfer_params: dict[str, Any] | None = None
    # A multimodal model's images, in prompt order (None: none).
    images: list[ImageInput] | None = None
    # A prompt given as embeddings (its prompt_token_ids are placeholders); None: tokens.
    prompt_embeds: PromptEmbeds | None = None
    # The LoRA adapter that runs it (None: the base model).
    lora: LoRAInput | None = None


class EngineCoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None


__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "SchedulerStats"]
