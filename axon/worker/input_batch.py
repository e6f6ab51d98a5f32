"""The worker's view of each request: tokens, blocks and sampling state, kept across steps.

The scheduler sends a request in full once and diffs afterwards; this is where the diffs land.
The worker appends the tokens it samples itself, so a decode step needs no token ids from the
scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from axon.pooling_params import EnginePoolingParams
from axon.sampling_params import EngineSamplingParams, SamplingType
from axon.scheduler_output import GrammarOutput, NewRequestData, SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: EngineSamplingParams | None
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    pooling_params: EnginePoolingParams | None = None
    # The KV cache's window group (the sliding-window layers' blocks); empty without one.
    window_block_ids: list[int] = field(default_factory=list)
    # A multimodal prompt's images (engine.messages.ImageInput), and once encoded their features
    # and positions (worker/multimodal.py: RequestImages).
    images: list[Any] | None = None
    encoded_images: Any = None
    # A prompt given as embeddings: [prompt length, hidden] on the device (None: tokens).
    prompt_embeds: torch.Tensor | None = None
    lora: Any = None  # its LoRA adapter (lora.request.LoRAInput), None: the base model
    token_ids: list[int] = field(init=False)  # prompt + output, kept in step
    # A pooling request's hidden states [n, hidden] of the prompt segments computed so far.
    hidden_parts: list[torch.Tensor] = field(default_factory=list)
    # Attention data parallelism: the rank that attends it (and holds its KV); 0 otherwise.
    attention_rank: int = 0

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RequestStates:
    """req_id -> CachedRequestState, updated from each SchedulerOutput."""

    def __init__(self, device: torch.device, attention_ranks: int = 1) -> None:
        self.device = device
        # Attention data parallelism: each new request goes to the rank attending the fewest
        # (then the lowest): every rank sees the same scheduler outputs, so all agree.
        self.attention_ranks = attention_ranks
        self.states: dict[str, CachedRequestState] = {}
        # A preempted request keeps its generator, so seeded sampling resumes where it stopped.
        self.preempted_generators: dict[str, torch.Generator] = {}
        # This step's structured-output bitmask rows (the sampler lines them up with its rows).
        self.grammar_output: GrammarOutput | None = None

    def update(self, sched: SchedulerOutput) -> None:
        self.grammar_output = sched.grammar_output
        for req_id in sched.preempted_req_ids:
            state = self.states.pop(req_id, None)
            if state is not None and state.generator is not None:
                self.preempted_generators[req_id] = state.generator
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
            self.preempted_generators.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.states[new.req_id] = self._make_state(new)
        diffs = sched.scheduled_cached_reqs
        for req_id, new_block_ids, num_kept, num_computed in zip(
            diffs.req_ids, diffs.new_block_ids, diffs.num_kept_blocks, diffs.num_computed_tokens, strict=True
        ):
            state = self.states[req_id]
            del state.block_ids[num_kept:]
            state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed
        for req_id, new_block_ids, num_kept in zip(
            diffs.req_ids, diffs.new_window_block_ids, diffs.num_kept_window_blocks, strict=False
        ):
            state = self.states[req_id]
            del state.window_block_ids[num_kept:]
            state.window_block_ids.extend(new_block_ids)

    def _make_state(self, new: NewRequestData) -> CachedRequestState:
        generator = self.preempted_generators.pop(new.req_id, None)
        params = new.sampling_params
        if generator is None and params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
            assert params.seed is not None
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        load = [0] * self.attention_ranks
        for state in self.states.values():
            load[state.attention_rank] += 1
        return CachedRequestState(
            attention_rank=load.index(min(load)),
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            window_block_ids=list(new.window_block_ids),
            images=new.images,
            prompt_embeds=None if new.prompt_embeds is None else new.prompt_embeds.tensor().to(self.device),
            lora=new.lora,
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
            pooling_params=new.pooling_params,
        )

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.states[req_id]
