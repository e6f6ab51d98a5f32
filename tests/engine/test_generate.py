"""End-to-end generation on SmolLM2 (float32) against transformers, and engine invariants."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from axon import LLM, SamplingParams

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "List three colours: red,",
    "In 1969, the first humans to walk on the Moon were",
    "Question: What is the boiling point of water at sea level in Celsius? Answer:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    return LLM(model=smollm2_path, dtype="float32", max_model_len=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_model(smollm2_path: str):
    return tf.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_generate(llm: LLM, hf_model) -> None:
    tokenizer = llm.get_tokenizer()
    # Both stop at EOS (transformers' min_new_tokens would mask EOS, unlike ignore_eos).
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        comp = out.outputs[0]
        assert comp.token_ids == ref[0, len(ids) :].tolist(), prompt
        assert comp.text == tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        assert comp.finish_reason == ("stop" if comp.token_ids[-1] == tokenizer.eos_token_id else "length")


def test_batch_invariance(llm: LLM) -> None:
    rng = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 40000, (int(n),), generator=rng).tolist()}
        for n in torch.randint(3, 60, (16,), generator=rng)
    ]
    batched = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert batched == alone


def test_prefix_caching_on_off_identical(smollm2_path: str, llm: LLM) -> None:
    shared = "You are a careful assistant. Answer briefly and precisely. " * 4
    prompts = [shared + q for q in ("What is rain?", "What is snow?", "What is hail?")]
    with_cache = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert with_cache[-1].num_cached_tokens > 0, "the shared prefix was not found in the cache"
    no_cache = LLM(
        model=smollm2_path, dtype="float32", max_model_len=512, max_num_seqs=4, enable_prefix_caching=False
    )
    without = no_cache.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in without)
    assert _tokens(with_cache) == _tokens(without)


def test_preemption_under_tiny_kv_pool(smollm2_path: str, llm: LLM) -> None:
    prompts = [p + " Tell me more." for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _tokens(llm.generate(prompts, params, use_tqdm=False))
    tiny = LLM(
        model=smollm2_path,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        block_size=16,
        num_gpu_blocks_override=12,
        admission_kv_limit=False,
    )
    got = tiny.generate(prompts, params, use_tqdm=False)
    assert tiny.llm_engine.engine_core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert _tokens(got) == expected
    pool = tiny.llm_engine.engine_core.scheduler.kv_cache_manager
    pool.check_integrity()
    assert pool.usage == 0.0


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    first = _tokens(llm.generate(PROMPTS[:3], params, use_tqdm=False))
    again = _tokens(llm.generate(PROMPTS[:3], params, use_tqdm=False))
    assert first == again
    # The same seeded request inside a different batch draws the same tokens.
    mixed = _tokens(llm.generate([PROMPTS[5], PROMPTS[1]], [GREEDY, params], use_tqdm=False))
    assert mixed[1] == first[1]
    other = _tokens(
        llm.generate(
            PROMPTS[:3],
            SamplingParams(temperature=0.9, seed=99, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
    )
    assert other != first


def test_n_greater_than_one_shares_prompt_blocks(llm: LLM) -> None:
    prompt = "Name a fruit that is " * 8  # several full blocks
    out = llm.generate(
        prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "children with different seeds all agreed"
    num_full_blocks = (len(out.prompt_token_ids) - 1) // 16
    assert out.num_cached_tokens == num_full_blocks * 16  # the later children reused the prompt's blocks


def test_stop_strings_spanning_tokens(llm: LLM) -> None:
    base = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0].text
    # A stop string that straddles a token boundary: take characters across the 3rd/4th words.
    stop = base[3:9]
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=32, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == base[: base.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=32, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base[: base.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[5]
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base[: base.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    eos = llm.get_tokenizer().eos_token_id
    chat = llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False
    )[0].outputs[0]
    assert chat.token_ids[-1] == eos and chat.finish_reason == "stop" and chat.stop_reason is None
    longer = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0, max_tokens=64, min_tokens=len(chat.token_ids) + 5),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(chat.token_ids) + 5
    assert eos not in longer.token_ids[: len(chat.token_ids) + 4]


def test_logprobs_and_prompt_logprobs_match_oracle(llm: LLM, hf_model) -> None:
    prompt = "Water boils at a temperature of"
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2), use_tqdm=False
    )[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for pos in range(1, n):
        entry = out.prompt_logprobs[pos][ids[pos]]
        assert entry.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert entry.rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
    comp = out.outputs[0]
    assert len(comp.logprobs) == 6
    total = 0.0
    for i, (tok, row) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        expected = ref[n - 1 + i]
        assert row[tok].rank == 1  # greedy
        assert row[tok].logprob == pytest.approx(expected[tok].item(), abs=1e-4)
        top = expected.topk(3).indices.tolist()
        assert set(top) <= set(row)
        total += row[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_chat_uses_the_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Italy?"}]
    tokenizer = llm.get_tokenizer()
    expected_ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    outs = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert outs[0].prompt_token_ids == expected_ids
    assert "Rome" in outs[0].outputs[0].text
    assert outs[0].outputs[0].text == outs[1].outputs[0].text


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_model_dir) -> None:
    """vLLM's --seed: two engines started with the same seed give the same samples to requests
    that give none; another seed gives others."""
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6, 7]}]

    def sample(seed: int) -> list[list[int]]:
        llm = LLM(model=path, seed=seed, dtype="float32", max_model_len=64, enforce_eager=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_greedy_in_half_precision(tiny_model_dir, dtype: str) -> None:
    """Greedy decoding in float16 and bfloat16, where the sampler reads the logits in the model's
    dtype without a float32 copy (float16 has no C++ argmax and takes torch's): each token is the
    one a fresh greedy request over the text before it picks."""
    llm = LLM(model=tiny_model_dir("llama"), dtype=dtype, max_model_len=64, enforce_eager=True)
    prompt = [1, 2, 3, 4]
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    tokens = out[0].outputs[0].token_ids
    assert len(tokens) == 4
    # Teacher-forced: the prompt and every generated token but the last, one request, greedy.
    forced = llm.generate(
        [{"prompt_token_ids": prompt + tokens[:i]} for i in range(4)],
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids[0] for o in forced] == tokens
