"""Logprobs of chosen tokens and of the top-K alternatives, as tensors and as plain lists."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axon.scheduler_output import LogprobsLists


@dataclass
class LogprobsTensors:
    """Column 0 is the chosen token, columns 1..K the top-K in descending logprob order."""

    token_ids: torch.Tensor  # [N, K+1] int64
    logprobs: torch.Tensor  # [N, K+1] float32
    # 1 + number of vocabulary entries with a strictly higher logprob than the chosen token.
    ranks: torch.Tensor  # [N] int64


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Log-softmax `logits` [N, V] (in float32) and gather the chosen `token_ids` [N] and the top-K."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
    return gather_logprobs(logprobs, token_ids, num_logprobs)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """From normalised `logprobs` [N, V]: the chosen tokens' entries, their ranks and the top-K."""
    assert 0 <= num_logprobs <= logprobs.shape[-1], (
        f"num_logprobs {num_logprobs} outside [0, {logprobs.shape[-1]}]"
    )
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)  # [N, 1]
    chosen = logprobs.gather(-1, token_ids)  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)  # [N, K]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=-1),  # [N, K+1]
        logprobs=torch.cat([chosen, top_logprobs], dim=-1),  # [N, K+1]
        ranks=ranks.to(torch.int64),
    )


def to_lists(t: LogprobsTensors, num_logprobs_per_row: list[int]) -> LogprobsLists:
    """Move to Python lists, keeping the chosen token plus each row's own K of the top-K."""
    assert len(num_logprobs_per_row) == t.token_ids.shape[0], (
        f"{len(num_logprobs_per_row)} row counts for {t.token_ids.shape[0]} rows"
    )
    assert all(0 <= k < t.token_ids.shape[1] for k in num_logprobs_per_row), (
        f"row counts {num_logprobs_per_row} exceed the {t.token_ids.shape[1] - 1} computed"
    )
    token_ids = t.token_ids.tolist()
    logprobs = t.logprobs.tolist()
    return LogprobsLists(
        token_ids=[row[: k + 1] for row, k in zip(token_ids, num_logprobs_per_row)],
        logprobs=[row[: k + 1] for row, k in zip(logprobs, num_logprobs_per_row)],
        ranks=t.ranks.tolist(),
    )
