"""The ``axon`` command against a real server: start-up log, ``chat --url``, ``bench serve``
through the chat endpoint, and the OpenAPI schema (served, and fuzzed: no 5xx)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from tests.server.conftest import ServerProcess

CLI = [sys.executable, "-m", "axon.entrypoints.cli"]
# Generation requests the fuzzer makes stay short: at most this many tokens and choices.
FUZZ_MAX_TOKENS = 4
FUZZ_MAX_N = 2


def test_startup_log_shows_phases_and_ready_only_after_the_model(server: ServerProcess) -> None:
    log = server.log()
    assert "Uvicorn running on" not in log
    listening = log.index(f"listening on http://127.0.0.1:{server.port}; loading the model")
    phases = [
        re.search(r"loading the weights of .*: done in [0-9.]+ s", log),
        re.search(
            r"KV cache size: \d+ blocks of \d+ bytes from auto: max_num_seqs 16 x max_model_len 512", log
        ),
        re.search(r"allocating the KV cache: .*: done in [0-9.]+ s", log),
        re.search(r"engine core ready in [0-9.]+ s", log),
    ]
    assert all(phases), log
    ready = log.index(f"axon serving SmolLM2-135M-Instruct at http://127.0.0.1:{server.port}")
    assert listening < min(m.start() for m in phases if m) and max(m.start() for m in phases if m) < ready


def test_openapi_schema_and_docs_are_served(server: ServerProcess) -> None:
    schema = httpx.get(server.url + "/openapi.json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    body_ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith("/ChatCompletionRequest")
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionResponse"
    )
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse"
    )
    assert "422" not in chat["responses"]  # invalid bodies get OpenAI's 400, not FastAPI's 422
    assert {"/v1/completions", "/v1/models", "/tokenize", "/v1/embeddings"} <= set(schema["paths"])
    docs = httpx.get(server.url + "/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_chat_url_streams_the_servers_answers(server: ServerProcess) -> None:
    """One line on stdin, the streamed answer on stdout, EOF ends the chat."""
    proc = subprocess.run(
        [*CLI, "chat", "--url", server.url + "/v1", "--max-tokens", "8", "--system-prompt", "Be brief."],
        input="What is 2 + 2?\n",
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    expected = server.client().chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=8,
        temperature=0,
    )
    answer = expected.choices[0].message.content
    assert answer and proc.stdout.startswith("> " + answer + "\n"), proc.stdout


def test_bench_serve_through_the_chat_endpoint(server: ServerProcess, tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CLI, "bench", "serve", "--base-url", server.url,
         "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
         "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
         "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"]) == (2, 0)
    assert (result["backend"], result["endpoint"]) == ("openai-chat", "/v1/chat/completions")
    assert result["total_output_tokens"] == 8


# ---- fuzzing the OpenAPI schema ---------------------------------------------------------------
@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> Any:
    config = schemathesis.Config.from_dict(
        {
            "seed": 14,
            "phases": {"examples": {"enabled": False}, "coverage": {"enabled": False}},
            "generation": {"max-examples": 40},
        }
    )
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)


fuzzed = schemathesis.pytest.from_fixture("api_schema")


def bound_generation(body: Any) -> None:
    """Keep generated generation requests short: the fuzzer is after bad input, not long runs."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"):
        if (
            not isinstance(body.get(key), int)
            or isinstance(body.get(key), bool)
            or body[key] > FUZZ_MAX_TOKENS
        ):
            body[key] = FUZZ_MAX_TOKENS if key != "min_tokens" else 0
    for key in ("n", "best_of"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > FUZZ_MAX_N:
            body[key] = FUZZ_MAX_N


@fuzzed.parametrize()
def test_fuzzed_requests_never_get_a_server_error(case: Any) -> None:
    bound_generation(case.body)
    case.call_and_validate(checks=[not_a_server_error], timeout=60)
