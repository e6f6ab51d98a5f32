"""Speculative decoding through the engine: greedy output identical to decoding without it for
every proposer, and every sampling option keeping its meaning (stops, max_tokens, penalties,
logprobs, seeds, preemption, structured outputs)."""

from __future__ import annotations

import json

import pytest
import torch

from axon import LLM, SamplingParams
from axon.engine.arg_utils import create_engine_config
from axon.model.layers.attention import get_attention_backend
from axon.model.loader import load_hf_config
from axon.sampling_params import StructuredOutputsParams
from axon.spec_decode.eagle3 import (
    build_eagle3,
    eagle3_hf_config,
    init_eagle3_weights,
    parse_eagle3_config,
    save_eagle3,
)

COMMON = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# Repetitive prompts (token ids of a tiny random model's vocabulary): the ngram lookup finds
# matches in them, so verification accepts and rejects both.
PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]},
    {"prompt_token_ids": [100, 200, 300, 100, 200, 300, 100, 200]},
    {"prompt_token_ids": list(range(30, 60)) + list(range(30, 40))},
    {"prompt_token_ids": [11, 12, 13]},
]


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def target(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def baseline(target: str) -> list[list[int]]:
    return _tokens(LLM(model=target, **COMMON))


@pytest.fixture(scope="module")
def eagle3_head(target: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random EAGLE3 head for the target, drafting from every other token id."""
    return _save_head(load_hf_config(target), str(tmp_path_factory.mktemp("eagle3-head")))


def _save_head(target_hf: dict, folder: str, **overrides) -> str:
    config = eagle3_hf_config(target_hf, draft_vocab_size=256, aux_layer_ids=(0, 1, 1)) | overrides
    head = build_eagle3(
        parse_eagle3_config(config, target_hf), torch.float32, "cpu", get_attention_backend("reference")
    )
    init_eagle3_weights(head, seed=0)
    head.set_vocab_map(torch.arange(0, target_hf["vocab_size"], 2))
    save_eagle3(head, folder, config)
    return folder


def _spec(method: str, model: str | None = None, k: int = 3) -> dict:
    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if model is not None:
        spec["model"] = model
    return spec


def _stats(llm: LLM) -> tuple[int, int]:
    """(draft tokens verified, accepted) so far, from the scheduler's counters."""
    stats = llm.llm_engine.engine_core.scheduler.spec_totals
    return stats.num_draft_tokens, stats.num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "draft_other", "draft_self", "eagle3"])
def test_greedy_output_is_unchanged(method: str, target: str, tiny_model_dir, eagle3_head, baseline) -> None:
    spec = {
        "ngram": _spec("ngram"),
        "draft_other": _spec("draft_model", tiny_model_dir("qwen2")),
        "draft_self": _spec("draft_model", target),
        "eagle3": _spec("eagle3", eagle3_head),
    }[method]
    llm = LLM(model=target, speculative_config=spec, **COMMON)
    assert _tokens(llm) == baseline
    drafted, accepted = _stats(llm)
    assert drafted > 0
    if method == "draft_self":
        # The target drafting for itself: every draft is accepted, but for a near-tie that the
        # draft's and the verification's different row counts round apart.
        assert accepted >= 0.95 * drafted
    else:
        assert accepted < drafted


def test_stops_and_max_tokens_cut_inside_a_verification(target: str, baseline) -> None:
    llm = LLM(model=target, speculative_config=_spec("draft_model", target, k=4), **COMMON)
    stop_at = baseline[0][6]
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_at], logprobs=2),
    ]
    outs = llm.generate(PROMPTS[:1] * 2, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[0] == baseline[0][:7]
    assert got[1] == baseline[0][: baseline[0].index(stop_at) + 1]
    # The logprobs of tokens verified after the stop are not reported.
    assert len(outs[1].outputs[0].logprobs) == len(got[1])


def test_penalties_logprobs_and_seeds(target: str) -> None:
    plain = LLM(model=target, **COMMON)
    spec = LLM(model=target, speculative_config=_spec("draft_model", target), **COMMON)
    penalized = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.5, frequency_penalty=0.5)
    assert _tokens(spec, params=penalized) == _tokens(plain, params=penalized)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True)
    a = spec.generate(PROMPTS, with_logprobs, use_tqdm=False)
    b = plain.generate(PROMPTS, with_logprobs, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert len(x.outputs[0].logprobs) == len(x.outputs[0].token_ids)
        for lx, ly, token in zip(
            x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids, strict=True
        ):
            assert lx[token].logprob == pytest.approx(ly[token].logprob, abs=1e-4)
    seeded = SamplingParams(temperature=1.0, max_tokens=30, seed=123, ignore_eos=True)
    assert _tokens(spec, params=seeded) == _tokens(spec, params=seeded)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_preemption_mid_verification(method: str, target: str, eagle3_head, baseline) -> None:
    llm = LLM(
        model=target,
        speculative_config=_spec(method, target if method == "draft_model" else eagle3_head),
        num_gpu_blocks_override=10,
        admission_kv_limit=False,
        max_num_batched_tokens=64,
        **(COMMON | {"max_model_len": 128}),
    )
    assert _tokens(llm) == baseline
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    llm.llm_engine.engine_core.scheduler.kv_cache_manager.check_integrity()


def test_eagle3_catches_up_over_prefill_segments(target: str, eagle3_head) -> None:
    """A prompt prefilled in chunks beside decoding requests: its segments' rows reach the head
    in steps that draft for the others, or wait for a later one."""
    long_prompt = {"prompt_token_ids": [(7 * i + 3) % 500 for i in range(70)]}
    prompts = [*PROMPTS, long_prompt]
    chunked = COMMON | {"max_num_batched_tokens": 32}
    plain = _tokens(LLM(model=target, **chunked), prompts)
    llm = LLM(model=target, speculative_config=_spec("eagle3", eagle3_head), **chunked)
    assert _tokens(llm, prompts) == plain
    assert _stats(llm)[0] > 0


def test_eagle3_compiled_equals_eager(target: str, eagle3_head, tmp_path) -> None:
    """The target's graphs return its aux hidden states too."""
    buckets = {"max_num_seqs": 4, "num_seqs_buckets": [4], "max_num_batched_tokens": 32}
    options = COMMON | buckets | {"speculative_config": _spec("eagle3", eagle3_head)}
    eager = _tokens(LLM(model=target, **options), PROMPTS)
    llm = LLM(model=target, enforce_eager=False, bucket_compile="warmup", cache_root=str(tmp_path), **options)
    compiler = llm.llm_engine.engine_core.executor.worker.compiler
    assert compiler.stats.records and not compiler.stats.failures
    assert _tokens(llm, PROMPTS) == eager
    assert compiler.stats.graph_steps > 0


def test_eagle3_head_of_another_width_fails_at_start_up(target: str, tmp_path) -> None:
    target_hf = load_hf_config(target)
    narrow = _save_head(target_hf | {"hidden_size": 32, "head_dim": 8}, str(tmp_path / "head"))
    with pytest.raises(ValueError, match="hidden_size 32 differs from the target's hidden_size 64"):
        create_engine_config(model=target, speculative_config=_spec("eagle3", narrow))


def test_structured_outputs_with_speculation(smollm2_path: str) -> None:
    """A constrained request beside free ones: its grammar holds, theirs speculate."""
    llm = LLM(model=smollm2_path, speculative_config=_spec("ngram"), **COMMON)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    free = SamplingParams(temperature=0.0, max_tokens=40)
    prompt = "Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"
    out = llm.generate([prompt, prompt], [constrained, free], use_tqdm=False)
    plain = LLM(model=smollm2_path, **COMMON).generate([prompt, prompt], [constrained, free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    text = out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "length" or "a" in json.loads(text), text
    assert _stats(llm)[0] > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_mixture_of_experts_targets_keep_their_greedy_output(
    family: str, method: str, tiny_model_dir, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Speculation on Qwen3-MoE and GPT-OSS (sinks, sliding windows: verification rows past the
    window), with an EAGLE3 head reading their auxiliary hidden states."""
    moe = tiny_model_dir(family)
    baseline = _tokens(LLM(model=moe, **COMMON))
    model = None
    if method == "eagle3":
        model = _save_head(load_hf_config(moe), str(tmp_path_factory.mktemp(f"eagle3-{family}")))
    llm = LLM(model=moe, speculative_config=_spec(method, model), **COMMON)
    assert _tokens(llm) == baseline
    assert _stats(llm)[0] > 0
