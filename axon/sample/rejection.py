"""The rejection sampler: verify each request's drafts against the target in one pass, losslessly.

Row layout of one verification (request r with k_r drafts owns k_r + 1 consecutive rows):

    rows:    | r0: d0 d1 d2 bonus | r1: bonus | r2: d0 d1 bonus |
    row j of a request holds the target's logits after its known tokens and drafts d_0..d_{j-1}

Every proposer drafts deterministically (ngram lookup, a draft model's or EAGLE3 head's
argmax), so the draft distribution q is one-hot and the speculative-sampling rule reduces to:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j)
    at the first rejection j: draw from the residual max(p_j - q_j, 0), normalized = p_j with
                              d_j removed, renormalized; the remaining drafts are dropped
    all accepted: draw the bonus token from the last row's p

so each emitted token has exactly the target's distribution p (vLLM's and Leviathan et al.'s
argument). Greedy rows accept while d_j equals the target's argmax, and emit the argmax at the
first mismatch: the output is token for token what decoding without speculation gives.
``p`` is the distribution the plain sampler draws from (penalties, bias, temperature, min_p,
top_k, top_p applied per row, each row seeing the drafts before it as output tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axon.sample.logprobs import LogprobsTensors, gather_logprobs
from axon.sample.metadata import SamplingMetadata
from axon.sample.sampler import apply_logits_processors, argmax, exponential_race, random_probs


@dataclass
class VerifyOutput:
    # Per request: its accepted drafts and one token more (the correction or the bonus).
    token_ids: list[list[int]]
    # Raw logprobs of every emitted token, requests' tokens in order; None if no row asks.
    logprobs: LogprobsTensors | None


def rejection_sample(
    logits: torch.Tensor,  # [R, V], R = sum(len(d) + 1 for d in drafts)
    metadata: SamplingMetadata,  # one row per logits row
    drafts: list[list[int]],
) -> VerifyOutput:
    num_rows = sum(len(d) + 1 for d in drafts)
    assert logits.shape[0] == num_rows == metadata.num_reqs, (
        f"{logits.shape[0]} logits rows, {metadata.num_reqs} metadata rows, {num_rows} verify rows"
    )
    raw_logprobs = None
    if metadata.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [R, V]
    processed = apply_logits_processors(logits.to(torch.float32, copy=True), metadata)  # [R, V]
    greedy = None if metadata.all_random else argmax(processed).tolist()  # [R]
    probs = None if metadata.all_greedy else random_probs(processed, metadata)  # [R, V]
    is_greedy = metadata.greedy_mask.tolist()
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    accepted = _accept(drafts, starts, is_greedy, greedy, probs, metadata.generators)
    tokens = [d[:a] for d, a in zip(drafts, accepted, strict=True)]
    final_rows = [start + a for start, a in zip(starts, accepted, strict=False)]
    finals = _final_tokens(drafts, accepted, final_rows, is_greedy, greedy, probs, metadata.generators)
    for out, token in zip(tokens, finals, strict=True):
        out.append(token)
    logprobs = None
    if raw_logprobs is not None:
        assert metadata.max_num_logprobs is not None
        rows = [start + j for start, out in zip(starts, tokens, strict=False) for j in range(len(out))]
        flat = torch.tensor([t for out in tokens for t in out], dtype=torch.int64)
        logprobs = gather_logprobs(raw_logprobs[rows], flat.to(logits.device), metadata.max_num_logprobs)
    return VerifyOutput(tokens, logprobs)


def _accept(
    drafts: list[list[int]],
    starts: list[int],
    is_greedy: list[bool],
    greedy: list[int] | None,
    probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> list[int]:
    """How many leading drafts each request accepts."""
    draft_rows = [
        starts[r] + j for r, d in enumerate(drafts) for j in range(len(d)) if not is_greedy[starts[r]]
    ]
    p_draft: list[float] = []
    uniform: list[float] = []
    if draft_rows:
        assert probs is not None
        ids = torch.tensor([t for r, d in enumerate(drafts) if not is_greedy[starts[r]] for t in d])
        p_draft = probs[draft_rows, ids.to(probs.device)].tolist()
        uniform = _uniform(draft_rows, generators)
    accepted, i = [], 0
    for r, d in enumerate(drafts):
        a = 0
        if is_greedy[starts[r]]:
            assert greedy is not None
            while a < len(d) and d[a] == greedy[starts[r] + a]:
                a += 1
        else:
            while a < len(d) and uniform[i + a] < p_draft[i + a]:
                a += 1
            i += len(d)
        accepted.append(a)
    return accepted


def _uniform(rows: list[int], generators: dict[int, torch.Generator]) -> list[float]:
    """One U(0, 1) draw per row; a seeded request's rows draw from its own generator."""
    out = torch.rand(len(rows)).tolist()
    for i, row in enumerate(rows):
        generator = generators.get(row)
        if generator is not None:
            out[i] = torch.rand(1, generator=generator, device=generator.device).item()
    return out


def _final_tokens(
    drafts: list[list[int]],
    accepted: list[int],
    final_rows: list[int],
    is_greedy: list[bool],
    greedy: list[int] | None,
    probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> list[int]:
    """Each request's token after its accepted drafts: the argmax for greedy rows; else a draw
    from the residual (the rejected draft removed) or, all accepted, from the bonus row."""
    random = [r for r, row in enumerate(final_rows) if not is_greedy[row]]
    finals = [greedy[row] if is_greedy[row] else -1 for row in final_rows] if greedy else [-1] * len(drafts)
    if not random:
        return finals
    assert probs is not None
    rows = [final_rows[r] for r in random]
    residual = probs[rows].clone()  # [n, V]
    for i, r in enumerate(random):
        if accepted[r] < len(drafts[r]):
            residual[i, drafts[r][accepted[r]]] = 0.0
    residual /= residual.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    row_generators = {i: generators[row] for i, row in enumerate(rows) if row in generators}
    for r, token in zip(random, exponential_race(residual, row_generators).tolist(), strict=True):
        finals[r] = token
    return finals
