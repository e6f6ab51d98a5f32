"""The sampler: one step's logits [B, V] to one token per request, in vLLM V1's order.

    raw logprobs (if asked) -> grammar bitmask -> min_tokens mask -> logit_bias -> penalties
        -> greedy rows: argmax
        -> random rows: temperature -> min_p -> top_k -> top_p -> exponential race

Every stage is batched over rows; only seeded rows' noise and logit_bias rows loop in Python.
Stages whose flag in SamplingMetadata says no row uses them are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axon.platforms.cpu_kernels import cpu_kernels_loaded
from axon.sample.grammar import apply_grammar_bitmask
from axon.sample.logprobs import LogprobsTensors, gather_logprobs
from axon.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Raw (unprocessed) logprobs of the sampled token and the top max_num_logprobs; None if no row asks.
    logprobs: LogprobsTensors | None


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_reqs, (
            f"logits of shape {tuple(logits.shape)} for {metadata.num_reqs} requests"
        )
        assert logits.shape[1] == metadata.vocab_size, (
            f"logits have {logits.shape[1]} columns, metadata a vocabulary of {metadata.vocab_size}"
        )
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            # Logprobs report the model's distribution, before any processing (as vLLM's default).
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [B, V]
        if metadata.all_greedy and not has_logits_processors(metadata):
            sampled = argmax(logits)  # nothing changes the logits: read them as they are, no copy
        else:
            # A private float32 copy: the stages below work in place and must not touch the caller's logits.
            logits = logits.to(torch.float32, copy=True)  # [B, V]
            logits = apply_logits_processors(logits, metadata)
            sampled = sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def has_logits_processors(metadata: SamplingMetadata) -> bool:
    """Whether apply_logits_processors changes any row's logits."""
    return (
        metadata.grammar_bitmask is not None
        or bool(metadata.min_tokens)
        or metadata.logit_bias is not None
        or not metadata.no_penalties
    )


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Grammar bitmask, min_tokens mask, logit_bias and penalties on float32 `logits` [B, V],
    in place where possible."""
    if metadata.grammar_bitmask is not None:
        logits = apply_grammar_bitmask(logits, metadata.grammar_bitmask)
    if metadata.min_tokens:
        logits = apply_min_tokens(logits, metadata.min_tokens)
    if metadata.logit_bias is not None:
        for row, token_ids, biases in metadata.logit_bias:
            logits[row].index_add_(0, token_ids, biases)
    if not metadata.no_penalties:
        assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
        logits = apply_penalties(
            logits,
            metadata.prompt_token_ids,
            metadata.output_token_ids,
            metadata.presence_penalties,
            metadata.frequency_penalties,
            metadata.repetition_penalties,
        )
    return logits


def apply_min_tokens(logits: torch.Tensor, stop_token_ids: dict[int, set[int]]) -> torch.Tensor:
    rows = [row for row, ids in stop_token_ids.items() for _ in ids]
    cols = [tok for ids in stop_token_ids.values() for tok in ids]
    index = (
        torch.tensor(rows, dtype=torch.int64, device=logits.device),  # [n]
        torch.tensor(cols, dtype=torch.int64, device=logits.device),  # [n]
    )
    return logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on `logits` [B, V]; token id tensors [B, L] are padded with V.

    Repetition (HF rule) counts prompt and output tokens; frequency and presence count output only.
    """
    vocab_size = logits.shape[1]
    output_counts = _bin_counts(output_token_ids, vocab_size)  # [B, V]
    output_mask = output_counts > 0  # [B, V]
    seen = (_bin_counts(prompt_token_ids, vocab_size) > 0) | output_mask  # [B, V]
    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # [B, V] float32 occurrence counts; the extra column V absorbs the padding and is dropped.
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(
        1, token_ids, torch.ones(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    )
    return counts[:, :vocab_size]


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Processed float32 `logits` [B, V] -> sampled token ids [B] int64, greedy and random rows mixed."""
    greedy = None if metadata.all_random else argmax(logits)  # [B]
    if metadata.all_greedy:
        assert greedy is not None
        return greedy
    sampled = exponential_race(random_probs(logits, metadata), metadata.generators)  # [B]
    if greedy is None:
        return sampled
    return torch.where(metadata.greedy_mask, greedy, sampled)


def random_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Processed float32 `logits` [B, V] -> the distribution random rows draw from [B, V]:
    temperature, min_p, top_k, top_p, softmax (in place on `logits`)."""
    # Greedy rows carry temperature 1.0, so this leaves them as they were (their result is discarded).
    logits = logits.div_(metadata.temperature.unsqueeze(1))
    if not metadata.no_min_p:
        logits = apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(
        logits,
        None if metadata.no_top_k else metadata.top_k,
        None if metadata.no_top_p else metadata.top_p,
    )
    return logits.softmax(dim=-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 or bfloat16 -> [B] int64, the first maximum of each row (as
    ``torch.argmax``), with axon's vectorized CPU kernel where it is loaded (torch's took ~20x
    longer)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and cpu_kernels_loaded()
        and logits.stride(-1) == 1
    ):
        return torch.ops.axon_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [B] times the row's largest (never the top one)."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k [B] largest logits, then its smallest nucleus of mass >= p [B].

    Sort-based: the sorted row is masked by position, so exactly k survive top-k even with ties,
    and the largest logit always survives top-p.
    """
    if k is None and p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [B, V] ascending
    vocab_size = logits.shape[1]
    if k is not None:
        positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
        logits_sort.masked_fill_(positions < (vocab_size - k).unsqueeze(1), float("-inf"))
    if p is not None:
        # Ascending cumulative mass: a token is dropped when all tokens at or below it hold <= 1 - p.
        cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        drop = cum_probs <= 1.0 - p.unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row of `probs` [B, V] as argmax(probs / q), q ~ Exponential(1).

    Equivalent to a categorical draw without a CPU sync. Seeded rows draw their own [V] of noise
    from their generator, so their tokens do not depend on the rest of the batch; unseeded rows
    share one batch draw from the global generator.
    """
    q = torch.empty_like(probs)  # [B, V]
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # q can be exactly 0; 0/0 would be NaN, which argmax picks. The clamp keeps masked tokens at 0.
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(dim=-1)
