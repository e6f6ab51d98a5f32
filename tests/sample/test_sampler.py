"""Sampler tests: exact checks for the deterministic stages, chi-square checks for the random ones.

Every random test fixes its seed, so the chi-square p-values are fixed numbers, not flaky ones.
"""

from __future__ import annotations

import pytest
import torch

from axon.platforms.cpu_kernels import load_cpu_kernels
from axon.sample.logprobs import compute_logprobs, to_lists
from axon.sample.metadata import SamplingMetadata, build_sampling_metadata
from axon.sample.sampler import Sampler, apply_logits_processors, argmax
from axon.sampling_params import EngineSamplingParams, SamplingParams

CPU = torch.device("cpu")
# Ten distinct logits in no particular order, so that index order and rank order differ.
LOGITS_10 = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, -2.0, 1.0, -0.5, 0.25, -1.5])
NUM_DRAWS = 20_000


def metadata(
    params: list[SamplingParams] | list[EngineSamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return build_sampling_metadata(
        [p if isinstance(p, EngineSamplingParams) else engine_params(p) for p in params],
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab_size,
        CPU,
    )


def engine_params(
    params: SamplingParams, eos_token_id: int | None = None, vocab_size: int = 1000
) -> EngineSamplingParams:
    """The engine's record of ``params``, as the input processor builds it."""
    return params.for_engine(eos_token_id, vocab_size, default_max_tokens=16)


def draw(
    params: SamplingParams, logits: torch.Tensor, num_draws: int = NUM_DRAWS, seed: int = 0
) -> torch.Tensor:
    """num_draws independent samples of one request: a batch of identical unseeded rows."""
    torch.manual_seed(seed)
    batch = logits.unsqueeze(0).expand(num_draws, -1).contiguous()  # [N, V]
    md = metadata([params] * num_draws, logits.shape[0])
    return Sampler()(batch, md).sampled_token_ids


def assert_distribution(samples: torch.Tensor, expected: torch.Tensor, alpha: float = 1e-3) -> None:
    """Zero mass outside expected's support, and a chi-square goodness-of-fit p-value above alpha."""
    counts = torch.bincount(samples, minlength=expected.shape[0]).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"samples outside the support: {counts[~support]}"
    if support.sum() == 1:
        return
    expected_counts = expected[support].double() * counts.sum()
    stat = ((counts[support] - expected_counts) ** 2 / expected_counts).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    p_value = torch.special.gammaincc(dof, stat / 2).item()
    assert p_value > alpha, (
        f"chi-square p={p_value:.2e}: counts {counts.tolist()} vs {expected_counts.tolist()}"
    )


def renormalised(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1) * keep
    return probs / probs.sum()


# --- greedy --------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    md = metadata([SamplingParams(temperature=0.0)] * 8, 100)
    assert md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_greedy_reads_bf16_logits_as_they_are_unless_a_processor_changes_them() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100).bfloat16()
    before = logits.clone()
    greedy = metadata([SamplingParams(temperature=0.0)] * 8, 100)
    out = Sampler()(logits, greedy)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    # A penalty changes the answer: the processed float32 copy decides, the caller's logits stay.
    top = logits.float().argmax(dim=-1)
    outputs = [[int(t)] * 5 for t in top]
    penalized = metadata(
        [SamplingParams(temperature=0.0, repetition_penalty=100.0)] * 8, 100, outputs=outputs
    )
    out = Sampler()(logits, penalized)
    assert not torch.equal(out.sampled_token_ids, top)
    assert torch.equal(logits, before)


def test_argmax_kernel_equals_torch_with_ties(kernel_cache_root: str) -> None:
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: argmax is torch's")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, vocab in [(1, 1), (3, 17), (16, 32000), (5, 49152)]:
            logits = torch.randn(rows, vocab, generator=gen).to(dtype)  # bf16: many ties
            # Ties: the first maximum wins, as torch.argmax has it.
            logits[0, vocab // 2 :] = logits[0].max() + 1
            got = torch.ops.axon_cpu.argmax_rows(logits)
            assert got.dtype == torch.int64 and torch.equal(got, logits.float().argmax(dim=-1))
            assert torch.equal(argmax(logits), got)
    # Other dtypes (float16 logits of a half-precision model) take torch's argmax.
    half = torch.randn(3, 50, generator=gen).half()
    assert torch.equal(argmax(half), half.argmax(dim=-1))
    # A row-strided view (rows picked out of a larger tensor) is read in place.
    wide = torch.randn(4, 100, generator=gen)
    assert torch.equal(argmax(wide[:, :60]), wide[:, :60].argmax(dim=-1))
    assert torch.equal(argmax(wide[:, ::2]), wide[:, ::2].argmax(dim=-1))  # not contiguous: torch's


def test_tiny_temperature_is_greedy_even_in_a_random_batch() -> None:
    torch.manual_seed(1)
    logits = torch.zeros(64, 50)
    logits[:, 7] = 0.1  # barely ahead: a random row would often miss it
    params = [SamplingParams(temperature=1e-6, seed=3) if i % 2 else SamplingParams() for i in range(64)]
    md = metadata(
        params, 50, generators=[torch.Generator().manual_seed(3) if i % 2 else None for i in range(64)]
    )
    assert not md.all_greedy and not md.all_random
    assert md.generators == {}  # a greedy row needs no noise, seeded or not
    sampled = Sampler()(logits, md).sampled_token_ids
    assert torch.all(sampled[1::2] == 7)
    assert not torch.all(sampled[0::2] == 7)


def test_mixed_greedy_and_random_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(40, 30) * 0.1  # nearly flat: random rows rarely hit the argmax
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(temperature=1.0) for i in range(40)
    ]
    sampled = Sampler()(logits, metadata(params, 30)).sampled_token_ids
    greedy_rows = torch.arange(40) % 3 == 0
    assert torch.equal(sampled[greedy_rows], logits.argmax(dim=-1)[greedy_rows])
    assert (sampled[~greedy_rows] != logits.argmax(dim=-1)[~greedy_rows]).sum() > 10


def test_bfloat16_logits() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 64).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 3 + [SamplingParams(top_k=5, logprobs=2)] * 3
    out = Sampler()(logits, metadata(params, 64))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids[:3], logits.float().argmax(dim=-1)[:3])
    top5 = logits.float().topk(5, dim=-1).indices[3:]
    assert all(int(t) in top5[i].tolist() for i, t in enumerate(out.sampled_token_ids[3:]))
    assert out.logprobs is not None and out.logprobs.logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, out.sampled_token_ids.unsqueeze(1))
    torch.testing.assert_close(out.logprobs.logprobs[:, :1], expected)


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 20)
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.5, top_k=3, logit_bias={1: 5.0}),
        SamplingParams(temperature=0.0),
    ]
    Sampler()(logits, metadata(params, 20, prompts=[[1, 2], [3]], outputs=[[4], []]))
    assert torch.equal(logits, before)


# --- random distributions ------------------------------------------------------------------------


def test_plain_sampling_matches_softmax() -> None:
    samples = draw(SamplingParams(), LOGITS_10)
    assert_distribution(samples, torch.softmax(LOGITS_10, dim=-1))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature: float) -> None:
    samples = draw(SamplingParams(temperature=temperature), LOGITS_10, seed=4)
    assert_distribution(samples, torch.softmax(LOGITS_10 / temperature, dim=-1))


def test_lower_temperature_is_sharper() -> None:
    top = int(LOGITS_10.argmax())
    hits = [
        (draw(SamplingParams(temperature=t), LOGITS_10, 5000) == top).float().mean() for t in (0.3, 1.0, 3.0)
    ]
    assert hits[0] > hits[1] > hits[2]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_draws_from_renormalised_top_k(k: int) -> None:
    keep = torch.zeros(10, dtype=torch.bool)
    keep[LOGITS_10.topk(k).indices] = True
    samples = draw(SamplingParams(top_k=k), LOGITS_10, seed=5)
    assert keep[samples].all()
    if k > 1:
        assert_distribution(samples, renormalised(LOGITS_10, keep))


def reference_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches top_p, by a plain loop."""
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for idx in probs.argsort(descending=True).tolist():
        keep[idx] = True
        mass += probs[idx].item()
        if mass >= top_p:
            break
    return keep


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.8])
def test_top_p_draws_from_renormalised_nucleus(top_p: float) -> None:
    keep = reference_nucleus(torch.softmax(LOGITS_10, dim=-1), top_p)
    samples = draw(SamplingParams(top_p=top_p), LOGITS_10, seed=6)
    if top_p == 0.05:
        assert keep.sum() == 1  # below the top token's mass: only the top token survives
    assert_distribution(samples, renormalised(LOGITS_10, keep))


@pytest.mark.parametrize("min_p", [0.1, 0.4])
def test_min_p_drops_unlikely_tokens(min_p: float) -> None:
    probs = torch.softmax(LOGITS_10, dim=-1)
    keep = probs >= min_p * probs.max()
    samples = draw(SamplingParams(min_p=min_p), LOGITS_10, seed=7)
    assert_distribution(samples, renormalised(LOGITS_10, keep))


def test_temperature_min_p_top_k_top_p_compose_in_order() -> None:
    scaled = LOGITS_10 / 0.7
    probs = torch.softmax(scaled, dim=-1)
    keep = probs >= 0.05 * probs.max()  # min_p on the tempered distribution
    top5 = torch.zeros_like(keep)
    top5[scaled.topk(5).indices] = True
    keep &= top5
    keep &= reference_nucleus(renormalised(scaled, keep), 0.8)  # top_p on the renormalised top-k
    samples = draw(SamplingParams(temperature=0.7, min_p=0.05, top_k=5, top_p=0.8), LOGITS_10, seed=8)
    assert_distribution(samples, renormalised(scaled, keep))


def test_seeded_row_matches_the_distribution() -> None:
    params = SamplingParams(top_k=6, seed=11)
    generator = torch.Generator().manual_seed(11)
    md = metadata([params], 10, generators=[generator])
    sampler = Sampler()
    samples = torch.cat([sampler(LOGITS_10.unsqueeze(0), md).sampled_token_ids for _ in range(3000)])
    keep = torch.zeros(10, dtype=torch.bool)
    keep[LOGITS_10.topk(6).indices] = True
    assert_distribution(samples, renormalised(LOGITS_10, keep))


# --- seeds ---------------------------------------------------------------------------------------


def run_seeded(
    seed: int, row: int, others: list[SamplingParams], step_logits: list[torch.Tensor]
) -> list[int]:
    """Tokens of one seeded request over several steps, placed at `row` among `others`."""
    params = others[:row] + [SamplingParams(seed=seed, top_p=0.9)] + others[row:]
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    sampler = Sampler()
    tokens = []
    for logits in step_logits:
        batch = torch.randn(len(params), logits.shape[0])
        batch[row] = logits
        md = metadata(params, logits.shape[0], generators=generators)
        tokens.append(int(sampler(batch, md).sampled_token_ids[row]))
    return tokens


def test_seeded_rows_reproduce_regardless_of_batch() -> None:
    torch.manual_seed(9)
    step_logits = [torch.randn(500) for _ in range(6)]
    alone = run_seeded(123, 0, [], step_logits)
    assert alone == run_seeded(123, 0, [], step_logits)
    others = [
        SamplingParams(),
        SamplingParams(seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
    ]
    assert alone == run_seeded(123, 2, others, step_logits)
    assert alone == run_seeded(123, 4, others, step_logits)
    assert alone != run_seeded(124, 0, [], step_logits)


def test_unseeded_runs_differ() -> None:
    logits = torch.zeros(32, 1000)
    md = metadata([SamplingParams()] * 32, 1000)
    sampler = Sampler()
    assert not torch.equal(sampler(logits, md).sampled_token_ids, sampler(logits, md).sampled_token_ids)


# --- logit processing ----------------------------------------------------------------------------

PENALTY_LOGITS = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, 0.0])
PROMPT, OUTPUT = [0, 1], [2, 4, 4]


def processed(params: SamplingParams, logits: torch.Tensor = PENALTY_LOGITS) -> torch.Tensor:
    md = metadata([params, SamplingParams()], 6, prompts=[PROMPT, PROMPT], outputs=[OUTPUT, OUTPUT])
    out = apply_logits_processors(torch.stack([logits, logits]).clone(), md)
    assert torch.equal(out[1], logits), "a row without penalties must be left alone"
    return out[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    # Seen (prompt or output): 0, 1, 2, 4.
    expected = torch.tensor([0.5, -2.0, 1.0, -2.0, 0.25, 0.0])
    assert torch.equal(processed(SamplingParams(repetition_penalty=2.0)), expected)


def test_frequency_penalty_counts_output_only() -> None:
    expected = torch.tensor([1.0, -1.0, 1.5, -2.0, -0.5, 0.0])  # 2 once, 4 twice
    assert torch.equal(processed(SamplingParams(frequency_penalty=0.5)), expected)


def test_presence_penalty_counts_output_only() -> None:
    expected = torch.tensor([1.0, -1.0, 1.75, -2.0, 0.25, 0.0])
    assert torch.equal(processed(SamplingParams(presence_penalty=0.25)), expected)


def test_all_penalties_together() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([0.5, -2.0, 0.25, -2.0, -1.0, 0.0])
    assert torch.equal(processed(params), expected)


def test_logit_bias_adds_and_forces_a_token() -> None:
    params = SamplingParams(temperature=0.0, logit_bias={5: 100.0, 2: -3.0})
    out = processed(params)
    assert torch.equal(out, PENALTY_LOGITS + torch.tensor([0.0, 0.0, -3.0, 0.0, 0.0, 100.0]))
    md = metadata([params], 6)
    assert int(Sampler()(PENALTY_LOGITS.unsqueeze(0), md).sampled_token_ids[0]) == 5


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    params = engine_params(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]), 9, 10)
    logits = torch.zeros(1, 10)
    logits[0, 9], logits[0, 7], logits[0, 3] = 3.0, 2.0, 1.0
    sampler = Sampler()
    md = metadata([params], 10, outputs=[[1, 2]])
    assert md.min_tokens == {0: {7, 9}}
    assert int(sampler(logits, md).sampled_token_ids[0]) == 3
    md = metadata([params], 10, outputs=[[1, 2, 3]])
    assert md.min_tokens == {}
    assert int(sampler(logits, md).sampled_token_ids[0]) == 9


def test_min_tokens_with_ignore_eos_masks_only_stop_ids() -> None:
    params = engine_params(
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7], ignore_eos=True), 9, 10
    )
    assert metadata([params], 10, outputs=[[]]).min_tokens == {0: {7}}


# --- metadata ------------------------------------------------------------------------------------


def test_metadata_flags_for_a_plain_batch() -> None:
    md = metadata([SamplingParams(), SamplingParams(seed=1)], 32, generators=[None, torch.Generator()])
    assert md.all_random and not md.all_greedy
    assert md.no_penalties and md.no_top_k and md.no_top_p and md.no_min_p
    assert md.prompt_token_ids is None and md.output_token_ids is None
    assert md.logit_bias is None and md.min_tokens == {} and md.max_num_logprobs is None
    assert list(md.generators) == [1]
    assert md.top_k.tolist() == [32, 32]


def test_metadata_pads_token_ids_with_vocab_size() -> None:
    params = [SamplingParams(repetition_penalty=1.1), SamplingParams(top_k=100, logprobs=3)]
    md = metadata(params, 50, prompts=[[1, 2, 3], [4]], outputs=[[], [5, 6]])
    assert not md.no_penalties
    assert md.no_top_k and md.top_k.tolist() == [50, 50]  # top_k beyond the vocabulary is a no-op
    assert md.max_num_logprobs == 3
    assert md.prompt_token_ids is not None and md.prompt_token_ids.tolist() == [[1, 2, 3], [4, 50, 50]]
    assert md.output_token_ids is not None and md.output_token_ids.tolist() == [[50, 50], [5, 6]]


# --- logprobs ------------------------------------------------------------------------------------


def test_sampler_logprobs_are_raw_and_ordered() -> None:
    torch.manual_seed(10)
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.3, top_k=10),
        SamplingParams(logprobs=1, temperature=0.0, logit_bias={0: 50.0}),
        SamplingParams(),
    ]
    out = Sampler()(logits, metadata(params, 40, prompts=[[1, 2], [3], [4]], outputs=[[5], [], []]))
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert int(sampled[1]) == 0  # the bias changes the choice, not the reported logprobs
    lp = out.logprobs
    assert lp.token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top = raw.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert torch.all(lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:])
    expected_ranks = (raw > raw.gather(1, sampled.unsqueeze(1))).sum(dim=-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)


def test_compute_logprobs_ranks_count_strictly_higher() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    t = compute_logprobs(logits, torch.tensor([1, 2]), num_logprobs=2)
    assert t.ranks.tolist() == [2, 1]  # ties do not push a token down
    assert t.token_ids[0].tolist()[0] == 1 and t.token_ids[0, 1].item() == 3
    assert t.token_ids.dtype == torch.int64 and t.logprobs.dtype == torch.float32
    empty = compute_logprobs(logits, torch.tensor([0, 0]), num_logprobs=0)
    assert empty.token_ids.shape == (2, 1)


def test_to_lists_trims_each_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    t = compute_logprobs(logits, torch.tensor([2, 0]), num_logprobs=3)
    lists = to_lists(t, [1, 3])
    assert lists.token_ids == [[2, 0], [0, 3, 2, 1]]
    assert len(lists.logprobs[0]) == 2 and len(lists.logprobs[1]) == 4
    assert lists.ranks == [3, 4]
    assert lists.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[[0, 3, 2, 1]].tolist())
