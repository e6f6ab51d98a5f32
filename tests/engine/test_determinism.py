"""The same request gives the same bits however it is served, in bfloat16.

A request's greedy tokens and their logprobs (compared exactly, not to a tolerance) must not
depend on its batch companions (1 to 31 random others, greedy or sampled, prompts of any
length, so the step's row counts and its mix of prefills and decodes vary), on a prefix-cache
hit, on a chunked prefill, on preemption and recomputation, on async scheduling, or on whether
its steps ran eagerly or in compiled graphs. float32 would hide most of this: bfloat16 rounds
every output, so a different order of one sum shows up in the tokens.
"""

from __future__ import annotations

import random

import pytest

from axon import LLM, SamplingParams

COMMON = {"dtype": "bfloat16", "max_model_len": 256, "block_size": 16, "seed": 0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


def _results(llm: LLM, prompts: list[list[int]], params) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append((list(c.token_ids), [next(iter(d.values())).logprob for d in c.logprobs or []]))
    return got


def _prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))]


def _companion_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.5:
        return SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True)
    return SamplingParams(
        temperature=1.0, seed=rng.randrange(1000), max_tokens=rng.randint(1, 30), ignore_eos=True
    )


@pytest.fixture(scope="module", params=["llama", "qwen3", "smollm2"])
def model(request, tiny_model_dir, smollm2_path) -> str:
    """Tiny random models (head dims 16 and 32: the plain and the AVX-512 kernels) and the
    bundled SmolLM2 (30 layers: where a changed sum order shows up most)."""
    return smollm2_path if request.param == "smollm2" else tiny_model_dir(request.param)


@pytest.fixture(scope="module")
def targets() -> list[list[int]]:
    rng = random.Random(7)
    return [_prompt(rng, 1, 3), _prompt(rng, 30, 40), _prompt(rng, 90, 120)]


@pytest.fixture(scope="module")
def alone(model: str, targets) -> list[tuple[list[int], list[float]]]:
    """Each target on an engine of its own, one at a time, no prefix caching."""
    llm = LLM(model=model, enable_prefix_caching=False, **COMMON)
    return [_results(llm, [t], GREEDY)[0] for t in targets]


def test_batched_with_random_companions_and_after_prefix_hits(model: str, targets, alone) -> None:
    # Chunked prefills (48 tokens a step) beside decodes; prefix caching on.
    llm = LLM(model=model, max_num_seqs=32, max_num_batched_tokens=48, **COMMON)
    rng = random.Random(3)
    for n in (1, 4, 13, 31):
        companions = [_prompt(rng, 1, 150) for _ in range(n)]
        order = list(range(len(targets) + n))
        rng.shuffle(order)
        prompts = targets + companions
        params = [GREEDY] * len(targets) + [_companion_params(rng) for _ in companions]
        got = _results(llm, [prompts[i] for i in order], [params[i] for i in order])
        by_index = dict(zip(order, got))
        for i in range(len(targets)):
            assert by_index[i] == alone[i], f"target {i} among {n} companions"
    # Every target now hits the prefix cache (whole prompts, then a shared first part).
    assert _results(llm, targets, GREEDY) == alone
    longer = [t + _prompt(rng, 5, 20) for t in targets]
    _results(llm, longer, GREEDY)  # cached: their prefixes, i.e. the targets' blocks
    assert _results(llm, targets[::-1], GREEDY) == alone[::-1]


def test_preempted_and_async(model: str, targets, alone) -> None:
    # A pool of ~3 sequences with optimistic admission: running requests are preempted and
    # their tokens recomputed as prefills; steps pipelined (async scheduling).
    llm = LLM(
        model=model,
        num_gpu_blocks_override=24,
        admission_kv_limit=False,
        async_scheduling=True,
        max_num_batched_tokens=64,
        **COMMON,
    )
    rng = random.Random(5)
    companions = [_prompt(rng, 60, 120) for _ in range(5)]
    params = [GREEDY] * len(targets) + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 5
    got = _results(llm, targets + companions, params)
    assert got[: len(targets)] == alone
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def test_compiled_graphs_equal_eager_steps(model: str, smollm2_path: str, targets, alone, tmp_path) -> None:
    if model == smollm2_path:
        pytest.skip("compiling SmolLM2's buckets takes a minute; the tiny models' graphs run the same ops")
    llm = LLM(
        model=model,
        enforce_eager=False,
        bucket_compile="warmup",
        cache_root=str(tmp_path),
        max_num_seqs=8,
        num_seqs_buckets=[8],
        max_num_batched_tokens=64,
        num_batched_tokens_buckets=[16, 64],
        **COMMON,
    )
    assert _results(llm, targets, GREEDY) == alone
    assert llm.llm_engine.engine_core.executor.worker.compiler.stats.graph_steps > 0
