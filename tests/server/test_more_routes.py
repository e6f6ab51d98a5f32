"""vLLM's other routes on a real ``axon serve`` (the bundled SmolLM2): chat with ``n`` > 1
streamed, ``/invocations`` (SageMaker), ``/reset_prefix_cache`` under ``VLLM_SERVER_DEV_MODE``,
``/load``, and ``suffix`` (fill-in-the-middle) where the tokenizer has the tokens."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from axon.entrypoints.openai.serving_completion import fim_tokens
from tests.server.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_chat_with_n_choices_streams_each(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    kwargs = {"model": model, "messages": MESSAGES, "n": 2, "max_tokens": 8, "seed": 3, "temperature": 1.0}
    whole = client.chat.completions.create(**kwargs)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(finishes) == {0, 1}


def test_invocations_routes_by_the_body(server: ServerProcess) -> None:
    model = server.client().models.list().data[0].id
    chat = httpx.post(
        server.url + "/invocations", json={"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(server.url + "/invocations", json={"prompt": "Hello", "max_tokens": 3}).json()
    assert completion["object"] == "text_completion" and completion["model"] == model
    for body, message in [
        ({"foo": 1}, "takes a chat"),
        ({"messages": "x"}, "messages"),
        ([1], "JSON object"),
    ]:
        bad = httpx.post(server.url + "/invocations", json=body)
        assert bad.status_code == 400 and message in bad.json()["error"]["message"]
    refused = httpx.post(server.url + "/invocations", json={"input": "x"})  # embeddings: not this model
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "wrong_model_type"


def test_reset_prefix_cache_forgets_cached_prompts(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    long_messages = [{"role": "user", "content": "Tell me about the history of the Roman Empire. " * 4}]

    def hits_after_request() -> float:
        before = server.metric("vllm:prefix_cache_hits_total")
        client.chat.completions.create(model=model, messages=long_messages, max_tokens=1)
        return server.metric("vllm:prefix_cache_hits_total") - before

    hits_after_request()
    assert hits_after_request() > 0  # the same prompt again: its blocks hit
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    assert hits_after_request() == 0  # forgotten
    assert server.metric("vllm:num_requests_running") == 0
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}


def test_reset_prefix_cache_is_a_dev_route() -> None:
    proc = ServerProcess()
    try:
        assert httpx.post(proc.wait_ready().url + "/reset_prefix_cache").status_code == 404
    finally:
        proc.stop()


def test_suffix_fills_the_middle_where_the_tokenizer_can(server: ServerProcess, smollm2_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert fim_tokens(tokenizer) is None  # SmolLM2 has no FIM tokens: the server says so
    bad = httpx.post(
        server.url + "/v1/completions", json={"prompt": "def f(", "suffix": "):", "max_tokens": 2}
    )
    assert bad.status_code == 400 and "fill-in-the-middle tokens" in bad.json()["error"]["message"]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]}
    )
    assert fim_tokens(tokenizer) == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
