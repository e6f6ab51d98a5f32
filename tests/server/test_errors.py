"""Every bad request gets its status and an OpenAI-shaped error, and the server keeps serving.

This module's server runs with an API key, two served model names, an inline chat template
``--enable-log-requests`` and ``--max-log-len``; the main module's server runs without a key (auth off).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import ServerProcess

KEY = "test-key"
NAMES = ["axon-test", "alias"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
USER = [{"role": "user", "content": "Hi"}]
LONG = "hello " * 600


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = [
        "--api-key",
        KEY,
        "--served-model-name",
        *NAMES,
        "--chat-template",
        TEMPLATE,
        "--enable-log-requests",
        "--max-log-len",
        "12",
    ]
    proc = ServerProcess(*args).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# A 1 x 1 PNG.
TINY_PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="

BAD_REQUESTS = [
    # (path, json body, status, param or None)
    (CHAT, {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages.0.role"),
    (CHAT, {"model": "axon-test"}, 400, "messages"),
    (CHAT, {"messages": USER, "top_p": 7}, 400, "top_p"),
    (CHAT, {"messages": USER, "n": 0}, 400, "n"),
    (CHAT, {"messages": USER, "max_tokens": 600}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, 400, None),
    (
        CHAT,
        # An image for a text-only model (the bundled SmolLM2): "this model takes no images".
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": TINY_PNG}}]}]},
        400,
        "messages",
    ),
    (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tool_choice",
    ),
    (CHAT, {"messages": USER, "stream": True, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model"),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "!"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": LONG}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [49152]}, 400, None),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [10**9]}, 400, None),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 30, "max_tokens": 10}, 400, "min_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "model": "nope", "stream": True}, 404, "model"),
    ("/v1/embeddings", {"input": "Hi"}, 400, None),  # a generative model: needs --runner pooling
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    # Integers msgpack cannot carry into the engine core, and values no sampler can use.
    (CHAT, {"messages": USER, "seed": 2**64}, 400, "seed"),
    (COMPLETIONS, {"prompt": "Hi", "seed": -(2**63) - 1}, 400, "seed"),
    (COMPLETIONS, {"prompt": "Hi", "top_k": 2**70}, 400, "top_k"),
    (CHAT, {"messages": USER, "temperature": float("inf")}, 400, "temperature"),
    (CHAT, {"messages": USER, "top_p": float("nan")}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "Hi", "repetition_penalty": float("inf")}, 400, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": float("nan")}}, 400, "logit_bias.5"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": float("-inf")}}, 400, "logit_bias.5"),
    (CHAT, {"messages": USER, "logit_bias": {"5": 1e9}}, 400, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"5": -100.5}}, 400, "logit_bias"),
    # n is capped at --max-num-seqs (16 here), never a 503 "retry later" nor minutes of work.
    (CHAT, {"messages": USER, "n": 1000}, 400, "n"),
    (COMPLETIONS, {"prompt": "Hi", "n": 17, "stream": True}, 400, "n"),
    # Lone surrogates: JSON can carry them, UTF-8 cannot.
    (COMPLETIONS, {"prompt": "\ud800"}, 400, "prompt"),
    ("/tokenize", {"prompt": "a\ud800b"}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content"),
]


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def post_raw(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """Python's JSON, which writes NaN, Infinity and lone surrogates (as "\\ud800") as clients can."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request(http: httpx.Client, path: str, body: dict, status: int, param: str | None) -> None:
    error = assert_openai_error(post_raw(http, path, body), status)
    if param is not None:
        assert error["param"] == param
    assert_still_serving(http)


def test_context_length_message_is_vllms(http: httpx.Client) -> None:
    error = assert_openai_error(http.post(CHAT, json={"messages": USER, "max_tokens": 600}), 400)
    assert error["message"].startswith(
        "This model's maximum context length is 512 tokens. However, you requested"
    )
    assert error["code"] == "context_length_exceeded"


def test_invalid_json_and_oversized_body(http: httpx.Client) -> None:
    r = http.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(r, 400)["message"]
    big = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    r = http.post(COMPLETIONS, content=big, headers={"content-type": "application/json"})
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    assert_openai_error(http.delete("/v1/models"), 405)
    assert_still_serving(http)


def test_auth(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}, headers=headers)
        assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert [m.id for m in server.client(api_key=KEY).models.list().data] == NAMES
    for path in ("/health", "/metrics", "/version"):  # vLLM leaves these open
        assert httpx.get(server.url + path).status_code == 200


def test_openai_client_exceptions(server: ServerProcess) -> None:
    client = server.client(api_key=KEY)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="alias", prompt="Hi", temperature=-1)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hi")
    assert e.value.code == "model_not_found"


def test_served_model_names(server: ServerProcess) -> None:
    r = server.client(api_key=KEY).completions.create(model="alias", prompt="Hi", max_tokens=1)
    assert r.model == NAMES[0]


def test_chat_template_flag_and_log_truncation(http: httpx.Client, server: ServerProcess, tokenizer) -> None:
    tokens = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert tokenizer.decode(tokens) == "user: Hi\nassistant:"
    http.post(COMPLETIONS, json={"prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 1})
    log = server.log()
    assert "prompt: 'abcdefghijkl'," in log and "mnopqrstuvwxyz" not in log


def test_cors_preflight(server: ServerProcess) -> None:
    r = httpx.options(
        server.url + CHAT,
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from axon.entrypoints.openai.cli_args import api_key

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_key(argparse.Namespace(api_key=None)) == "from-env"
    assert api_key(argparse.Namespace(api_key="flag")) == "flag"


def test_same_request_id_twice_at_once(http: httpx.Client, server: ServerProcess) -> None:
    """A client's request_id is its own business: the engine's ids stay unique, both succeed."""
    body = {"messages": USER, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "request_id": "dup"}
    paths = [CHAT, CHAT, COMPLETIONS, COMPLETIONS]
    bodies = [body, {**body, "stream": True}, {"prompt": "Hi", **body}, {"prompt": "Hi", **body}]
    bodies[2].pop("messages")
    bodies[3].pop("messages")
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda pb: http.post(pb[0], json=pb[1], timeout=120), zip(paths, bodies)))
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert responses[0].json()["id"] == "chatcmpl-dup"  # the client's id stays visible
    assert responses[2].json()["id"] == responses[3].json()["id"] == "cmpl-dup"
    assert all(
        r.json()["usage"]["completion_tokens"] == 8 for r in (responses[0], responses[2], responses[3])
    )
    assert "data: [DONE]" in responses[1].text and '"error"' not in responses[1].text
    assert httpx.get(server.url + "/health").status_code == 200
    assert_still_serving(http)
