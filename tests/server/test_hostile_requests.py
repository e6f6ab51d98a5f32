"""Requests that once froze or loaded the server: heavy chat templates, multi-megabyte prompts,
and unauthenticated uploads. Each runs against a real ``axon serve``; /health must keep
answering while the work runs, and refusals must come before the expensive part."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from conftest import ServerProcess

API_KEY = "secret-key"
# Two nested loops (360,000 iterations in jinja) before the usual rendering: seconds of CPU.
HEAVY_TEMPLATE = (
    "{% for i in range(600) %}{% for j in range(600) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
HEALTH_BOUND_S = 2.0  # generous: the loop is never blocked for more than a few milliseconds


@pytest.fixture(scope="module")
def server() -> ServerProcess:  # type: ignore[misc]
    proc = ServerProcess("--api-key", API_KEY, "--max-model-len", "8192").wait_ready()
    yield proc
    proc.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _slowest_health_while(server: ServerProcess, work) -> tuple[float, httpx.Response]:
    """Run ``work`` (an HTTP call) and poll /health meanwhile; the slowest /health, the result."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(work)
        slowest = 0.0
        while not future.done():
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.05)
        return slowest, future.result()


def test_request_chat_template_needs_the_operator_flag(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, json=body, headers=_auth(), timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_huge_prompt_is_refused_before_tokenizing(server: ServerProcess) -> None:
    prompt = "hello world " * 2_500_000  # 30 MB, under the 32 MiB body limit
    start = time.monotonic()
    body = {"prompt": prompt, "truncate_prompt_tokens": 32}  # truncation does not lift the bound
    r = httpx.post(server.url + "/v1/completions", json=body, headers=_auth(), timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 30  # seconds for the upload and JSON parse, not tokenizing
    messages = [{"role": "user", "content": prompt}]
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": messages}, headers=_auth(), timeout=120
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]


def test_long_prompt_tokenizes_off_the_event_loop(server: ServerProcess) -> None:
    # Just under the character bound (8,192 tokens x 81 characters, SmolLM2's longest entry):
    # about a second of tokenizer time, in a worker thread, while /health keeps answering;
    # then refused by its token count.
    prompt = "hello world " * 55_000
    for path, body in (("/v1/completions", {"prompt": prompt}), ("/tokenize", {"prompt": prompt})):
        slowest, r = _slowest_health_while(
            server, lambda: httpx.post(server.url + path, json=body, headers=_auth(), timeout=300)
        )
        assert slowest < HEALTH_BOUND_S
        if path == "/tokenize":
            assert r.status_code == 200 and r.json()["count"] > 100_000, r.text[:300]
        else:
            assert r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


def test_unauthenticated_upload_is_refused_before_its_body_is_read(server: ServerProcess) -> None:
    url = urlparse(server.url)
    declared = 30 * 1024 * 1024
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {declared}\r\n\r\n".encode()
            + b"{"  # one byte of the 30 MB: the answer must not wait for the rest
        )
        answer = b""
        while b"invalid_api_key" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer, answer[:300]


def test_heavy_trusted_template_keeps_health_answering() -> None:
    trusted = ServerProcess("--trust-request-chat-template").wait_ready()
    try:
        body = {
            "messages": [{"role": "user", "content": "Say hi."}],
            "chat_template": HEAVY_TEMPLATE,
            "max_tokens": 2,
        }

        def chat() -> httpx.Response:
            return httpx.post(trusted.url + "/v1/chat/completions", json=body, timeout=300)

        slowest, r = _slowest_health_while(trusted, chat)
        assert r.status_code == 200, r.text[:300]
        assert slowest < HEALTH_BOUND_S
        r = httpx.post(trusted.url + "/tokenize", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["count"] > 0
    finally:
        trusted.stop()
