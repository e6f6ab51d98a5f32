"""``axon bench serve`` against a small OpenAI-compatible SSE peer started in the test.

The peer streams ``max_tokens`` text chunks, the first after FIRST_DELAY_S and each next one
ITL_DELAY_S later, then a usage block, and records what it saw: payloads, arrival times and the
most simultaneous requests. It is a test peer for the client, not a stand-in for axon.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from axon.entrypoints.bench_serve import (
    add_bench_parser,
    count_tokens,
    load_tokenizer,
    main,
    request_intervals,
)

FIRST_DELAY_S = 0.06
ITL_DELAY_S = 0.02
PEER_MODEL = "peer-model"
CHUNK_TEXT = " tok"


class Peer:
    def __init__(self) -> None:
        self.reset()
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def reset(self) -> None:
        self.payloads: list[dict] = []
        self.paths: list[str] = []
        self.arrivals: list[float] = []
        self.active = 0
        self.max_active = 0

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": PEER_MODEL, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        self.paths.append(request.path)
        self.arrivals.append(time.perf_counter())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._stream(request, payload)
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, payload: dict) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "peer refuses"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(data: dict | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            await response.write(f"data: {text}\n\n".encode())

        if chat:  # a role-only first chunk, as OpenAI sends: no text, so not the first token
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await response.write(b": keep-alive\n\n")
        for i in range(payload["max_tokens"]):
            await asyncio.sleep(FIRST_DELAY_S if i == 0 else ITL_DELAY_S)
            key = {"delta": {"content": CHUNK_TEXT}} if chat else {"text": CHUNK_TEXT}
            await send({"choices": [{"index": 0, **key, "finish_reason": None}]})
        if "NOUSAGE" not in prompt:
            usage = {"prompt_tokens": 1, "completion_tokens": payload["max_tokens"], "total_tokens": 0}
            await send({"choices": [], "usage": usage})
        await send("[DONE]")
        await response.write_eof()
        return response


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


@pytest.fixture
def fresh_peer(peer: Peer) -> Peer:
    peer.reset()
    return peer


def bench(peer: Peer, tokenizer_path: str, tmp_path: Path, *flags: str) -> dict:
    result_file = tmp_path / "result.json"
    argv = [
        "serve",
        "--port", str(peer.port),
        "--tokenizer", tokenizer_path,
        "--disable-tqdm",
        "--save-result",
        "--result-filename", str(result_file),
        *flags,
    ]  # fmt: skip
    assert main(argv) == 0
    return json.loads(result_file.read_text())


def test_random_completions_all_at_once(fresh_peer: Peer, smollm2_path: str, tmp_path: Path) -> None:
    r = bench(
        fresh_peer, smollm2_path, tmp_path,
        "--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "5", "--ignore-eos",
    )  # fmt: skip
    for name in (
        "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "duration", "max_concurrency", "request_rate",
    ):  # fmt: skip
        assert name in r, name
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in r, f"{stat}_{metric}_ms"
    assert (r["completed"], r["failed"]) == (6, 0)
    assert r["total_output_tokens"] == 30  # from the usage blocks
    tokenizer = load_tokenizer(smollm2_path)
    prompts = [p["prompt"] for p in fresh_peer.payloads]
    assert r["total_input_tokens"] == sum(count_tokens(tokenizer, p) for p in prompts)
    assert all(abs(count_tokens(tokenizer, p) - 32) <= 2 for p in prompts)
    assert len(set(prompts)) == 6
    # The peer's delays, plus a little for the loop and the network.
    assert FIRST_DELAY_S * 1000 <= r["mean_ttft_ms"] < FIRST_DELAY_S * 1000 + 60
    assert ITL_DELAY_S * 1000 * 0.9 <= r["median_itl_ms"] < ITL_DELAY_S * 1000 + 30
    assert ITL_DELAY_S * 1000 * 0.9 <= r["mean_tpot_ms"] < ITL_DELAY_S * 1000 + 30
    assert r["mean_e2el_ms"] >= (FIRST_DELAY_S + 4 * ITL_DELAY_S) * 1000
    assert len(r["itls"]) == 6 and all(len(gaps) == 4 for gaps in r["itls"])
    assert r["request_rate"] == "inf" and r["max_concurrency"] is None
    assert r["output_throughput"] == pytest.approx(30 / r["duration"])
    assert fresh_peer.max_active == 6  # inf rate, no limit: all in flight together
    for payload in fresh_peer.payloads:
        assert payload["model"] == PEER_MODEL  # asked /v1/models
        assert payload["max_tokens"] == 5 and payload["ignore_eos"] is True
        assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}


def test_max_concurrency_is_respected(fresh_peer: Peer, smollm2_path: str, tmp_path: Path) -> None:
    r = bench(
        fresh_peer, smollm2_path, tmp_path,
        "--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "3",
        "--max-concurrency", "2", "--random-range-ratio", "0.5",
    )  # fmt: skip
    assert (r["completed"], r["failed"]) == (8, 0)
    assert fresh_peer.max_active == 2
    assert r["max_concurrency"] == 2 and r["max_concurrent_requests"] == 2
    assert "ignore_eos" not in fresh_peer.payloads[0]
    # Four waves of two: at least four times one request's duration.
    assert r["duration"] >= 4 * (FIRST_DELAY_S + ITL_DELAY_S)
    assert r["total_output_tokens"] == sum(p["max_tokens"] for p in fresh_peer.payloads)
    assert {p["max_tokens"] for p in fresh_peer.payloads} <= {1, 2, 3, 4}


def test_request_rate_spaces_arrivals(fresh_peer: Peer, smollm2_path: str, tmp_path: Path) -> None:
    flags = ["--request-rate", "25", "--seed", "3", "--num-prompts", "6"]
    r = bench(
        fresh_peer, smollm2_path, tmp_path, *flags, "--random-input-len", "8", "--random-output-len", "1"
    )
    assert (r["completed"], r["failed"]) == (6, 0)
    assert r["request_rate"] == 25.0
    expected_spread = sum(request_intervals(6, 25.0, 1.0, 3)[:-1])
    spread = fresh_peer.arrivals[-1] - fresh_peer.arrivals[0]
    assert expected_spread - 0.01 <= spread <= expected_spread + 0.1
    # One output token: no ITL or TPOT samples, reported as 0.
    assert r["mean_itl_ms"] == 0.0 and r["mean_tpot_ms"] == 0.0


def test_request_intervals() -> None:
    assert request_intervals(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = request_intervals(20000, 10.0, 1.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.03)
    bursty = request_intervals(20000, 10.0, 0.25, 0)
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.06)
    assert request_intervals(5, 10.0, 1.0, 7) == request_intervals(5, 10.0, 1.0, 7)


def test_chat_jsonl_with_failures_and_no_usage(fresh_peer: Peer, smollm2_path: str, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "Hello there", "output_len": 3},
        {"prompt": "please FAIL", "output_len": 3},
        {"prompt": "NOUSAGE here", "output_len": 4},
    ]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    r = bench(
        fresh_peer, smollm2_path, tmp_path,
        "--endpoint", "/v1/chat/completions", "--model", "my-model",
        "--dataset-name", "jsonl", "--dataset-path", str(dataset), "--num-prompts", "3",
    )  # fmt: skip
    assert (r["completed"], r["failed"]) == (2, 1)
    tokenizer = load_tokenizer(smollm2_path)
    assert r["total_input_tokens"] == count_tokens(tokenizer, "Hello there") + count_tokens(
        tokenizer, "NOUSAGE here"
    )
    # 3 from the usage block, and the text of the usage-less stream counted with the tokenizer.
    assert r["total_output_tokens"] == 3 + count_tokens(tokenizer, CHUNK_TEXT * 4)
    assert sum("HTTP 500" in e for e in r["errors"]) == 1
    assert set(fresh_peer.paths) == {"/v1/chat/completions"}
    assert all(p["model"] == "my-model" for p in fresh_peer.payloads)
    assert r["mean_ttft_ms"] >= FIRST_DELAY_S * 1000  # the role-only chunk is not the first token


def test_cli_wiring_and_bad_input(capsys: pytest.CaptureFixture[str], smollm2_path: str) -> None:
    parser = argparse.ArgumentParser(prog="axon")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "serve", "--num-prompts", "3", "--request-rate", "2.5"])
    assert args.command == "bench" and args.bench_command == "serve"
    assert args.num_prompts == 3 and args.request_rate == 2.5
    from axon.entrypoints.bench_serve import run_bench

    assert args.bench_func is run_bench
    assert main(["serve", "--num-prompts", "0"]) == 2
    assert "--num-prompts must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--dataset-name", "jsonl"]) == 2
    assert "needs --dataset-path" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    assert main(["serve", "--port", str(closed_port), "--tokenizer", smollm2_path, "--num-prompts", "1"]) == 2
    assert f"cannot reach the server at http://127.0.0.1:{closed_port}" in capsys.readouterr().err


def test_result_table_is_printed(
    fresh_peer: Peer, smollm2_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench(fresh_peer, smollm2_path, tmp_path, "--num-prompts", "2", "--random-input-len", "4",
          "--random-output-len", "2", "--metric-percentiles", "50,99")  # fmt: skip
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert "Successful requests:                     2" in out
    for title in ("Time to First Token", "Inter-token Latency", "End-to-end Latency"):
        assert title in out
    assert "P50 TTFT (ms):" in out and "P99 ITL (ms):" in out
