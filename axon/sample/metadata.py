"""SamplingMetadata: one step's per-request sampling options, batched into tensors.

Row i of every tensor is request i of the step's batch. The flags are computed once here so
that the sampler skips whole stages (penalties, top-k, top-p, min-p, logprobs) when no row in
the batch uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axon.sample.grammar import GrammarBitmask
from axon.sampling_params import EngineSamplingParams, SamplingType


@dataclass
class SamplingMetadata:
    # Greedy rows hold 1.0 here (not their ~0 temperature), so dividing the whole batch is safe.
    temperature: torch.Tensor  # [B] float32
    greedy_mask: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool

    top_k: torch.Tensor  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor  # [B] float32, 0.0 where disabled
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool

    # Seeded random rows only: row -> that request's own generator.
    generators: dict[int, torch.Generator]
    # Largest `logprobs` asked for in the batch; None when no row asks.
    max_num_logprobs: int | None

    no_penalties: bool
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    # Built only when some row has a penalty; padded with vocab_size (an id no logit has).
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64
    output_token_ids: torch.Tensor | None  # [B, max_output_len] int64

    # (row, token ids [n] int64, biases [n] float32) for each row with a logit_bias.
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] | None
    # row -> stop token ids to mask while that row has produced fewer than min_tokens tokens.
    min_tokens: dict[int, set[int]]

    vocab_size: int
    # Structured outputs: packed allowed-token rows for the constrained rows (None: no row is).
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]


def build_sampling_metadata(
    params: list[EngineSamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    num_reqs = len(params)
    assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_reqs, (
        f"index-aligned inputs differ in length: {len(params)} params, {len(prompt_token_ids)} prompts, "
        f"{len(output_token_ids)} outputs, {len(generators)} generators"
    )
    is_greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    no_penalties = all(
        pp == 0.0 and fp == 0.0 and rp == 1.0 for pp, fp, rp in zip(presence, frequency, repetition)
    )
    requested = [p.logprobs for p in params if p.logprobs is not None]

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return SamplingMetadata(
        temperature=f32([1.0 if g else p.temperature for p, g in zip(params, is_greedy)]),
        greedy_mask=torch.tensor(is_greedy, dtype=torch.bool, device=device),
        all_greedy=all(is_greedy),
        all_random=not any(is_greedy),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=f32([p.top_p for p in params]),
        min_p=f32([p.min_p for p in params]),
        no_top_k=all(k == vocab_size for k in top_k),
        no_top_p=all(p.top_p == 1.0 for p in params),
        no_min_p=all(p.min_p == 0.0 for p in params),
        generators={i: g for i, g in enumerate(generators) if g is not None and not is_greedy[i]},
        max_num_logprobs=max(requested) if requested else None,
        no_penalties=no_penalties,
        presence_penalties=f32(presence),
        frequency_penalties=f32(frequency),
        repetition_penalties=f32(repetition),
        prompt_token_ids=None if no_penalties else _pad(prompt_token_ids, vocab_size, device),
        output_token_ids=None if no_penalties else _pad(output_token_ids, vocab_size, device),
        logit_bias=_logit_bias(params, device),
        min_tokens={
            i: set(p.all_stop_token_ids)
            for i, (p, out) in enumerate(zip(params, output_token_ids))
            if len(out) < p.min_tokens and p.all_stop_token_ids
        },
        vocab_size=vocab_size,
    )


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    # [B, max_len] int64; at least one column so that an all-empty batch still has a valid shape.
    max_len = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [pad_id] * (max_len - len(r)) for r in rows], dtype=torch.int64, device=device)


def _logit_bias(
    params: list[EngineSamplingParams], device: torch.device
) -> list[tuple[int, torch.Tensor, torch.Tensor]] | None:
    out = [
        (
            i,
            torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device),  # [n]
            torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device),  # [n]
        )
        for i, p in enumerate(params)
        if p.logit_bias
    ]
    return out or None
