"""Attention data parallelism (``attention_dp_size`` = tensor_parallel_size) through the offline
``LLM``: every rank holds the whole attention layer and attends only its own requests (their KV
stays on that rank), while the MLP or the experts, the embedding and the LM head stay split.

It must give what one rank gives (float32, to rounding): greedy tokens and top log-probabilities
for dense, mixture-of-experts (with expert parallelism: vLLM's DP attention + EP) and GPT-OSS
(sinks, sliding windows) models, with a rank that has no request in a step, and with prefills
chunked across steps.
"""

from __future__ import annotations

import pytest

from axon import LLM, SamplingParams
from axon.engine.arg_utils import create_engine_config
from tests.distributed.test_tensor_parallel import OPTIONS, PARAMS, PROMPTS, _assert_same, _run

ADP = {"tensor_parallel_size": 2, "attention_dp_size": 2}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss"])
def test_attention_dp2_equals_one_rank(tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family)
    _assert_same(_run(folder), _run(folder, **ADP))


def test_attention_dp2_with_expert_parallel_experts_equals_one_rank(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen3_moe")
    _assert_same(_run(folder), _run(folder, enable_expert_parallel=True, **ADP))


def test_one_request_leaves_a_rank_without_rows(tiny_model_dir) -> None:
    """One request at a time: rank 1 attends nothing in any step, and still takes its part in
    every collective. Prefill chunks of 8 tokens."""
    folder = tiny_model_dir("qwen2")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    out = {}
    for name, options in (("one", {}), ("adp", ADP)):
        llm = LLM(model=folder, **{**OPTIONS, "max_num_batched_tokens": 8, **options})
        out[name] = [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        llm.llm_engine.engine_core.shutdown()
    assert out["adp"] == out["one"]


def test_many_requests_spread_over_both_ranks(tiny_model_dir) -> None:
    """Twelve requests of different lengths at once, finishing at different steps: each new one
    goes to the rank attending fewer."""
    folder = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)]} for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True) for i in range(12)]
    texts = {}
    for name, options in (("one", {}), ("adp", ADP)):
        llm = LLM(model=folder, **{**OPTIONS, "max_num_seqs": 12, "max_model_len": 64, **options})
        texts[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.engine_core.shutdown()
    assert texts["adp"] == texts["one"]


def test_vllm_neurons_additional_config_key_and_refusals(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    config = create_engine_config(
        model=folder, tensor_parallel_size=2, additional_config={"neuron_config": {"attention_dp_size": 2}}
    )
    assert config.parallel_config.attention_dp_size == 2 and config.compilation_config.enforce_eager
    with pytest.raises(ValueError, match=r"attention_dp_size must be 1 or tensor_parallel_size \(2\)"):
        create_engine_config(model=folder, tensor_parallel_size=2, attention_dp_size=3)
    with pytest.raises(
        ValueError, match="attention_dp_size cannot be combined with decode_context_parallel_size"
    ):
        create_engine_config(
            model=tiny_model_dir("llama_one_kv_head_odd_vocab"),
            tensor_parallel_size=2,
            attention_dp_size=2,
            decode_context_parallel_size=2,
        )
    with pytest.raises(ValueError, match="attention_dp_size runs its steps eagerly"):
        create_engine_config(model=folder, enforce_eager=False, **ADP)
