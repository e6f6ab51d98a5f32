"""The records that cross between the scheduler and the worker: the only types the worker sees.

New requests are sent in full once; requests already on the worker are sent as diffs (new
block ids and the step's token count). A request resumed after preemption is sent in full again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from axon.pooling_params import EnginePoolingParams
from axon.sampling_params import EngineSamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty for a fresh request).
    output_token_ids: list[int]
    sampling_params: EngineSamplingParams | None  # None: a pooling request
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: EnginePoolingParams | None = None
    # The KV cache's window group (sliding-window layers; 0 for blocks out of the window); empty
    # without one.
    window_block_ids: list[int] = field(default_factory=list)
    # A multimodal prompt's images (engine.messages.ImageInput), None: none.
    images: list[Any] | None = None
    # A prompt given as embeddings (multimodal.inputs.PromptEmbeds), None: tokens.
    prompt_embeds: Any = None
    # Its LoRA adapter (lora.request.LoRAInput), None: the base model.
    lora: Any = None


@dataclass
class CachedRequestData:
    """Diffs for requests the worker already holds, index-aligned lists."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's block table this step, after its first num_kept_blocks
    # (fewer than the worker holds when the scheduler released rejected drafts' blocks).
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_kept_blocks: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # The same for the window group's table (empty lists without one). Entries that fell out of
    # the window are not sent again: no query reads them.
    new_window_block_ids: list[list[int]] = field(default_factory=list)
    num_kept_window_blocks: list[int] = field(default_factory=list)


@dataclass
class GrammarOutput:
    """This step's structured-output constraint: row i of ``bitmask`` masks request ``req_ids[i]``.

    Only requests that sample this step and are constrained have a row. ``bitmask`` is packed
    [len(req_ids), ceil(vocab_size / 32)] int32 (a numpy array): bit j of word w allows token
    32 * w + j.
    """

    req_ids: list[str]
    bitmask: Any


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step: the scheduler's whole decision.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were preempted since the last step: the worker drops their state.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    grammar_output: GrammarOutput | None = None
    # Speculative decoding: req_id -> the drafts verified this step (their KV is among the
    # scheduled tokens), and how many tokens each request that samples should draft next.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_draft_tokens: int = 0
    # The KV connector's work for this step (axon/kv_transfer/base.py: KVConnectorMetadata).
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Top logprobs of sampled positions: one row per token, the sampled token first.

    token_ids[i] = [sampled, top1, top2, ...]; logprobs[i] aligned; ranks[i] = rank of sampled.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class BucketStep(msgspec.Struct):
    """The static shape one step ran at (msgspec: it reaches the metrics in the front end)."""

    name: str  # vllm-neuron's label: decode_b8, prefill_s1024
    num_tokens: int  # real tokens
    padded_tokens: int  # the bucket


class CompileEvent(msgspec.Struct):
    name: str  # the bucket's label
    seconds: float
    cache_hit: bool


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request; empty when the step only advanced a prefill segment.
    sampled_token_ids: list[list[int]]
    # req_id -> logprobs of the tokens sampled this step (only for requests asking for them).
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> logprobs for the prompt positions computed this step (first position excluded).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    bucket: BucketStep | None = None
    # req_id -> the finished vector of each pooling request whose prompt completed this step.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: req_id -> the tokens drafted for the next step (absent: none);
    # sampled_token_ids then holds a request's accepted drafts and one token more.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # What the KV connector finished (axon/kv_transfer/base.py: KVConnectorOutput); None: no connector.
    kv_connector_output: Any = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
