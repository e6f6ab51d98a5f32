"""The rejection sampler by its invariants: greedy rows give the target's argmax chain, random
rows keep the target's distribution (chi-square on a tiny vocabulary), seeds repeat."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from axon.sample.metadata import build_sampling_metadata
from axon.sample.rejection import rejection_sample
from axon.sampling_params import EngineSamplingParams

VOCAB = 6


GREEDY = EngineSamplingParams(max_tokens=100, all_stop_token_ids=frozenset(), temperature=0.0)
RANDOM = EngineSamplingParams(max_tokens=100, all_stop_token_ids=frozenset(), temperature=1.0)
GREEDY_LOGPROBS = EngineSamplingParams(
    max_tokens=100, all_stop_token_ids=frozenset(), temperature=0.0, logprobs=2
)


def _metadata(params: list[EngineSamplingParams], generators=None):
    n = len(params)
    return build_sampling_metadata(
        params, [[0]] * n, [[]] * n, generators or [None] * n, VOCAB, torch.device("cpu")
    )


def test_greedy_accepts_the_argmax_chain_and_corrects_the_first_miss() -> None:
    logits = torch.full((7, VOCAB), -1.0)
    argmaxes = [3, 1, 4, 2, 5, 0, 2]  # request 0: 3 drafts + bonus; request 1: 2 drafts + bonus
    logits[range(7), argmaxes] = 5.0
    drafts = [[3, 1, 4], [5, 1]]
    params = [GREEDY] * 7
    out = rejection_sample(logits, _metadata(params), drafts)
    # Request 0: every draft is the argmax, then the bonus row's argmax. Request 1: 5 matches,
    # 1 does not (argmax 0): the correction is the argmax of that row.
    assert out.token_ids == [[3, 1, 4, 2], [5, 0]]


def test_no_drafts_is_one_token_per_request() -> None:
    logits = torch.randn(2, VOCAB)
    out = rejection_sample(logits, _metadata([GREEDY] * 2), [[], []])
    assert out.token_ids == [[int(logits[0].argmax())], [int(logits[1].argmax())]]


def test_random_rows_keep_the_target_distribution() -> None:
    """Drafts d0 = 2, d1 = 4 against fixed rows p0, p1, p2: the first token is distributed as
    p0 and, after an accepted d0, the second as p1, whatever the drafts were."""
    torch.manual_seed(0)
    logits = torch.tensor([[0.5, 1.0, 0.2, -0.3, 0.9, 0.0], [0.1, -0.2, 0.7, 0.3, 0.4, 1.1], [0.0] * VOCAB])
    p = logits.softmax(dim=-1)
    n = 8000
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    params = [RANDOM] * 3
    for _ in range(n):
        out = rejection_sample(logits.clone(), _metadata(params), [[2, 4]])
        tokens = out.token_ids[0]
        first[tokens[0]] += 1
        if tokens[0] == 2:
            second[tokens[1]] += 1
    assert chisquare(first.numpy(), (p[0] * n).numpy()).pvalue > 1e-3
    m = second.sum()
    assert chisquare(second.numpy(), (p[1] * m).numpy()).pvalue > 1e-3


def test_seeded_rows_repeat() -> None:
    logits = torch.randn(4, VOCAB)
    params = [RANDOM] * 4

    def run() -> list[list[int]]:
        g = torch.Generator().manual_seed(7)
        return rejection_sample(logits.clone(), _metadata(params, [g] * 4), [[1, 2, 3]]).token_ids

    assert run() == run()


def test_logprobs_have_one_row_per_emitted_token() -> None:
    logits = torch.randn(4, VOCAB)
    drafts = [[int(logits[0].argmax()), (int(logits[1].argmax()) + 1) % VOCAB, 0]]
    out = rejection_sample(logits, _metadata([GREEDY_LOGPROBS] * 4), drafts)
    assert out.token_ids[0][0] == drafts[0][0] and len(out.token_ids[0]) == 2
    assert out.logprobs is not None and out.logprobs.token_ids.shape[0] == 2
    assert out.logprobs.token_ids[:, 0].tolist() == out.token_ids[0]
