"""Decode context parallelism through the offline ``LLM``: ranks of a tensor-parallel group that
hold the same KV head each keep every other position of each sequence (``mp`` executor, one
process per rank, shared-memory collectives).

It must give what one rank gives (float32, to rounding: each rank's softmax covers half the keys
and the halves merge by log-sum-exp): greedy tokens and top log-probabilities, through prefills
chunked across steps, prefix-cache hits, compiled buckets and both attention backends that
implement it; and a block id must cover decode_context_parallel_size times the positions.
"""

from __future__ import annotations

import pytest

from axon import LLM, SamplingParams
from axon.engine.arg_utils import create_engine_config
from tests.distributed.test_tensor_parallel import OPTIONS, _assert_same

# Long enough to span several blocks of 16 x 2 positions, and to share a 40-token prefix.
SHARED = [(7 * i + 3) % 400 + 5 for i in range(40)]
PROMPTS = [[5, 17, 42, 9, 300, 12], SHARED + [11, 12, 13], [3], SHARED + [99] * 30]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=3)


def _run(folder: str, rounds: int = 1, **options):
    """Greedy tokens and top log-probabilities per prompt, each round's (a round after the first
    hits the prefix cache: its prompts' full blocks are cached)."""
    llm = LLM(model=folder, **{**OPTIONS, **options})
    results = []
    for _ in range(rounds):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        for out in outputs:
            positions = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
            lps = [{t: lp.logprob for t, lp in d.items()} for d in positions]
            results.append((out.outputs[0].token_ids, lps))
    llm.llm_engine.engine_core.shutdown()
    return results


@pytest.mark.parametrize("backend", ["cpu_flash", "reference"])
@pytest.mark.parametrize("family", ["llama_one_kv_head_odd_vocab", "qwen3_one_kv_head"])
def test_dcp2_equals_one_rank(tiny_model_dir, family: str, backend: str) -> None:
    """TP=2 with DCP=2: both ranks hold the one KV head, each half of its positions. Prefills
    are chunked (16 tokens a step) and the second round reads cached prefix blocks."""
    folder = tiny_model_dir(family)
    small_steps = {"max_num_batched_tokens": 16, "attention_backend": backend}
    want = _run(folder, rounds=2, **small_steps)
    got = _run(folder, rounds=2, tensor_parallel_size=2, decode_context_parallel_size=2, **small_steps)
    _assert_same(want, got)


def test_dcp2_within_tp4_equals_one_rank(tiny_model_dir) -> None:
    """Two KV heads on four ranks: ranks 0-1 share one, 2-3 the other; each pair is a group.
    (Four ranks on this suite's two CPUs: unpinned, one thread each.)"""
    folder = tiny_model_dir("llama")
    four = {"tensor_parallel_size": 4, "omp_threads_bind": "nobind", "num_threads": 1}
    _assert_same(_run(folder), _run(folder, decode_context_parallel_size=2, **four))


def test_dcp2_compiled_buckets_equal_eager_one_rank(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen3_one_kv_head")
    compiled = {"enforce_eager": False, "bucket_compile": "warmup", "max_num_batched_tokens": 32}
    _assert_same(
        _run(folder), _run(folder, tensor_parallel_size=2, decode_context_parallel_size=2, **compiled)
    )


def test_a_block_holds_dcp_times_the_positions(tiny_model_dir) -> None:
    """5 blocks (one the null block) of 16 tokens cannot hold a 128-token sequence on one rank;
    with DCP=2 each block id covers 32 positions (16 on each rank), and 4 x 32 = 128 fit."""
    folder = tiny_model_dir("llama_one_kv_head_odd_vocab")
    small = {**OPTIONS, "num_gpu_blocks_override": 5}
    with pytest.raises(ValueError, match="fewer than the 9 that one sequence of max_model_len=128 needs"):
        LLM(model=folder, **small)
    llm = LLM(model=folder, tensor_parallel_size=2, decode_context_parallel_size=2, **small)
    long_prompt = [(5 * i) % 500 + 3 for i in range(100)]
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 28  # 128 positions in 4 blocks
    llm.llm_engine.engine_core.shutdown()


def test_what_cannot_be_sharded_is_refused_before_loading(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")  # 2 KV heads
    with pytest.raises(
        ValueError, match=r"decode_context_parallel_size must divide tensor_parallel_size \(1\)"
    ):
        create_engine_config(model=folder, decode_context_parallel_size=2)
    with pytest.raises(
        ValueError,
        match="decode_context_parallel_size 2 needs each KV head on a multiple of 2 ranks, but tensor_parallel_size 2 "
        "puts each of the model's 2 KV heads on 1: use a tensor_parallel_size that is a multiple of 4",
    ):
        create_engine_config(model=folder, tensor_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="does not support kv_cache_dtype 'fp8' yet"):
        create_engine_config(
            model=tiny_model_dir("llama_one_kv_head_odd_vocab"),
            tensor_parallel_size=2,
            decode_context_parallel_size=2,
            kv_cache_dtype="fp8",
        )
