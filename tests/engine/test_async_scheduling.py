"""Async scheduling (step N+1 scheduled while step N runs on the worker thread) gives exactly
the outputs of synchronous steps, through the real engine and model."""

from __future__ import annotations

import random

import pytest

from axon import LLM, SamplingParams


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].logprobs)
        for o in outs
    ]


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        if kind == 0:  # greedy to a length
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True))
        elif kind == 1:  # seeded sampling with logprobs
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=16, logprobs=2, ignore_eos=True))
        elif kind == 2:  # stops on frequent tokens, after a minimum
            params.append(
                SamplingParams(
                    temperature=1.0, seed=i, max_tokens=30, stop_token_ids=list(range(3, 200)), min_tokens=2
                )
            )
        else:  # penalties read the tokens of the step before
            params.append(
                SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True)
            )
    return prompts, params


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
def test_async_equals_sync(tiny_model_dir, preempt: bool) -> None:
    folder = tiny_model_dir("llama")
    # Small token budget: long prompts are prefilled over several steps beside decodes. The
    # preempting pool holds ~2 sequences with optimistic admission, so running requests are
    # preempted while their token is in flight.
    kv = dict(num_gpu_blocks_override=12, admission_kv_limit=False) if preempt else {}
    common = dict(
        model=folder,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=6,
        block_size=16,
        max_num_batched_tokens=48,
        **kv,
    )
    prompts, params = _workload(seed=1 + preempt)
    sync = LLM(async_scheduling=False, **common)
    want = _run(sync, prompts, params)
    pipelined = LLM(async_scheduling=True, **common)
    core = pipelined.llm_engine.engine_core
    assert core.async_scheduling
    got = _run(pipelined, prompts, params)
    assert got == want
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.usage == 0.0
    if preempt:
        assert core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    # A second batch on the same engine: nothing left in flight from the first.
    assert _run(pipelined, prompts[:3], params[:3]) == want[:3]


def test_async_scheduling_is_off_on_the_cpu_by_default(tiny_model_dir) -> None:
    llm = LLM(model=tiny_model_dir("llama"), dtype="float32", max_model_len=64, device="cpu")
    assert llm.llm_engine.engine_core.async_scheduling is False
