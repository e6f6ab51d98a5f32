"""``axon serve --tensor-parallel-size 3`` on the bundled SmolLM2 (9 heads, 3 KV heads: 3 ranks
split them evenly; on a 2-core machine the ranks share the cores, ``nobind``), through the
official client: the server's main job, streaming, the same greedy text as one rank, and a rank
that dies taking the server down with a 503 and a non-zero exit, never a hang."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from conftest import ServerProcess

TP_ARGS = ("--tensor-parallel-size", "3", "--omp-threads-bind", "nobind")
START_S = 300.0  # three ranks load on two cores
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def tp_server() -> Iterator[ServerProcess]:
    server = ServerProcess(*TP_ARGS).wait_ready(START_S)
    yield server
    server.stop()


def _rank_pids(server: ServerProcess) -> list[int]:
    """The worker processes' pids, by rank, as the engine logs them (the engine core has other
    children too, such as multiprocessing's resource tracker)."""
    found = re.search(r"3 worker processes ready \(pids \[([0-9, ]+)\]\)", server.log())
    assert found, server.log()
    return [int(pid) for pid in found.group(1).split(",")]


def test_chat_without_max_tokens_stops_by_itself(tp_server: ServerProcess) -> None:
    reply = tp_server.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" in choice.message.content
    assert all(psutil.pid_exists(pid) for pid in _rank_pids(tp_server))


def test_streamed_and_greedy_text_equals_one_rank(tp_server: ServerProcess) -> None:
    prompt = "The three primary colors are"
    stream = tp_server.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    one_rank = ServerProcess().wait_ready()
    try:
        want = one_rank.client().completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0
        )
    finally:
        one_rank.stop()
    assert streamed == want.choices[0].text


def test_bad_request_is_400_and_the_server_keeps_serving(tp_server: ServerProcess) -> None:
    r = httpx.post(
        tp_server.url + "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": -1},
        timeout=30,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    ok = tp_server.client().completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_a_dead_rank_turns_health_503_and_the_server_exits_non_zero(tp_server: ServerProcess) -> None:
    # Last in the module: it ends the shared server.
    pid = _rank_pids(tp_server)[1]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            health = httpx.get(tp_server.url + "/health", timeout=5)
        except httpx.TransportError:
            break  # already gone
        if health.status_code == 503:
            break
        time.sleep(0.2)
    assert tp_server.proc.wait(timeout=20) != 0
    log = tp_server.log()
    assert f"worker rank 1 (pid {pid}) exited with code -9" in log


def test_two_engine_cores_of_two_ranks_each_answer_as_one_rank(tiny_model_dir) -> None:
    """--data-parallel-size 2 --tensor-parallel-size 2: two engine cores, each with its own
    group of two worker processes (four ranks sharing two cores, nobind)."""
    folder = tiny_model_dir("llama_full_vocab")
    prompts = [f"Story number {i}:" for i in range(6)]
    texts = []
    for args in (
        ("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--omp-threads-bind", "nobind"),
        (),
    ):
        server = ServerProcess(folder, *args).wait_ready(START_S)
        try:
            client = server.async_client()

            async def ask(prompt: str, client=client) -> str:
                reply = await client.completions.create(
                    model=folder, prompt=prompt, max_tokens=8, temperature=0
                )
                return reply.choices[0].text

            async def ask_all() -> list[str]:
                return await asyncio.gather(*(ask(p) for p in prompts))

            texts.append(asyncio.run(ask_all()))
            if args:
                assert server.log().count("2 worker processes ready") == 2
                served = server.successes_per_engine()
                assert served.keys() == {"0", "1"} and all(served.values())
        finally:
            server.stop()
    assert texts[0] == texts[1]
