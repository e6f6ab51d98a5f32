"""The OpenAI endpoints through the official client against one real server process."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from conftest import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def chat_prompt_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_health_version(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 512
    for path in ("/health", "/ping"):
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_startup_line_and_no_request_log_by_default(server: ServerProcess, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Quiet please", max_tokens=1)
    log = server.log()
    assert "axon serving" in log and server.url in log
    assert "Received request" not in log  # vLLM logs requests only with --enable-log-requests


def test_chat_usage_equals_token_counts(client: openai.OpenAI, tokenizer) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == len(choice.logprobs.content) <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy takes the top token
        assert entry.top_logprobs[0].token == entry.token


def test_chat_content_parts_and_max_completion_tokens(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Name a colour."}]
    a = client.chat.completions.create(
        model=MODEL,
        messages=[MESSAGES[0], {"role": "user", "content": parts}],
        max_completion_tokens=6,
        temperature=0,
    )
    b = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 6


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_n_and_seed(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == a.usage.total_tokens - a.usage.prompt_tokens >= 3
    stream = client.chat.completions.create(**kwargs, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_completion_text_and_usage(client: openai.OpenAI, tokenizer) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_completion_prompt_forms(client: openai.OpenAI, tokenizer) -> None:
    prompts = ["Hello, my name is", "The sky is"]
    ids = [tokenizer.encode(p) for p in prompts]
    kwargs = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    by_text = client.completions.create(prompt=prompts, n=2, **kwargs)
    by_ids = client.completions.create(prompt=ids, n=2, **kwargs)
    one_ids = client.completions.create(prompt=ids[1], **kwargs)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert by_text.choices[2].text == one_ids.choices[0].text
    assert by_text.usage.prompt_tokens == sum(map(len, ids))


def test_completion_echo_and_legacy_logprobs(client: openai.OpenAI, tokenizer) -> None:
    prompt = "The sky is"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = r.choices[0]
    lp = choice.logprobs
    num_prompt = len(tokenizer.encode(prompt))
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == choice.text
    for token, top in zip(lp.tokens[num_prompt:], lp.top_logprobs[num_prompt:], strict=True):
        assert token in top and len(top) <= 3


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "logprobs": 1}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == full.choices[0].logprobs.text_offset
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_strings(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 20, "temperature": 0}
    free = client.completions.create(**kwargs).choices[0].text
    stop = free.strip()[:3].strip() or free[:2]
    r = client.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(**kwargs, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop)


def test_vllm_extra_sampling_fields(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"11": -100},
        user="tester",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 5,
            "ignore_eos": True,
            "skip_special_tokens": True,
            "chat_template_kwargs": {},
        },
    )
    assert r.usage.completion_tokens == 5


def test_tokenize_detokenize(server: ServerProcess, tokenizer) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512 and len(r["token_strs"]) == r["count"]
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] == chat_prompt_len(tokenizer, MESSAGES)
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d == {"prompt": "Hello world"}


def test_concurrent_streams_equal_sequential(server: ServerProcess) -> None:
    prompts = [f"Write the number {i} in words:" for i in range(32)]
    kwargs = {"model": MODEL, "max_tokens": 8, "temperature": 0}

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(prompt=prompt, stream=True, **kwargs)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def together() -> list[str]:
        async with server.async_client() as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    concurrent = asyncio.run(together())
    client = server.client()
    sequential = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    assert concurrent == sequential
    assert all(concurrent)


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        # Hold the line iterator: a discarded one is closed, and httpcore closes the connection
        # with it, which would disconnect before the check below.
        lines = r.iter_lines()
        for i, _ in enumerate(lines):
            if i >= 8:
                break
        assert server.metric("vllm:kv_cache_usage_perc") > 0
    assert _eventually(lambda: server.metric("vllm:kv_cache_usage_perc") == 0.0)
    # a non-streaming client that gives up is aborted too
    try:
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    except httpx.TimeoutException:
        pass
    assert _eventually(lambda: server.metric("vllm:kv_cache_usage_perc") == 0.0)
    assert httpx.get(server.url + "/load").json()["server_load"] == 0


def _eventually(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_execution_metrics_on_the_page(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    client.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(server.url + "/metrics").text
    # A 1-request decode runs in the 1-row bucket; start-up times are reported once.
    assert _eventually(lambda: server.metric("axon:bucket_execution_count_total") >= 1)
    assert 'bucket_name="decode_b1"' in httpx.get(server.url + "/metrics").text
    assert server.metric("axon:num_seqs_padding_count") >= 3
    assert server.metric("axon:model_load_time_seconds") > 0
    assert server.metric("axon:startup_time_seconds") > 0
    assert "axon:num_batched_tokens_padding_bucket" in text
