"""``axon serve --data-parallel-size 2`` through real server processes with the official client:
two engine cores behind one endpoint answer concurrent greedy requests with the very tokens one
core gives, both get work (``engine`` label on /metrics), a chat with no max_tokens stops by
itself, and one core's death is the whole engine's: /health 503 naming it, in-flight requests
fail, the server exits non-zero and no core outlives it. The choice of core is tested by its
invariants in tests/engine/test_data_parallel_front_end.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from conftest import COMPLETION_PROMPTS as PROMPTS
from conftest import ServerProcess, serve_usage_error

DP2 = ("--data-parallel-size", "2")
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What is 17 times 3?",
    "Give me a synonym for happy.",
    "Which planet is the largest?",
    "Translate 'good morning' into Spanish.",
    "What do bees make?",
    "Tell me a fun fact about octopuses.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "Name a famous painting.",
    "What is the opposite of cold?",
    "What colour is a ripe banana?",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    started = {"dp1": ServerProcess(), "dp2": ServerProcess(*DP2)}
    try:
        yield {name: proc.wait_ready() for name, proc in started.items()}
    finally:
        for proc in started.values():
            proc.stop()


def _chat(server: ServerProcess, question: str, max_tokens: int | None = MAX_TOKENS) -> tuple[str, str]:
    client = server.client()
    kwargs = {"max_tokens": max_tokens} if max_tokens is not None else {}
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        **kwargs,
    )
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def _complete(server: ServerProcess, prompt: str) -> tuple[str, str]:
    client = server.client()
    reply = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
    )
    return reply.choices[0].text, reply.choices[0].finish_reason


def _all_at_once(server: ServerProcess) -> list[tuple[str, str]]:
    """The 16 chats and 16 completions, 32 in flight together."""
    with ThreadPoolExecutor(len(QUESTIONS) + len(PROMPTS)) as pool:
        chats = [pool.submit(_chat, server, q) for q in QUESTIONS]
        completions = [pool.submit(_complete, server, p) for p in PROMPTS]
        return [f.result() for f in chats + completions]


def _core_pids(server: ServerProcess) -> dict[int, int]:
    """engine index -> the pid its READY reported (the server logs it with several cores)."""
    return {int(i): int(pid) for i, pid in re.findall(r"engine core (\d) ready: pid (\d+)", server.log())}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_32_concurrent_greedy_requests_get_the_tokens_one_core_gives(
    servers: dict[str, ServerProcess],
) -> None:
    one_core = _all_at_once(servers["dp1"])
    two_cores = _all_at_once(servers["dp2"])
    assert all(text for text, _ in one_core)
    for prompt, got, want in zip(QUESTIONS + PROMPTS, two_cores, one_core, strict=True):
        assert got == want, f"{prompt!r}: {got!r} on two cores, {want!r} on one"


def test_both_cores_get_work_and_report_under_their_engine_label(servers: dict[str, ServerProcess]) -> None:
    server = servers["dp2"]
    before = server.successes_per_engine()
    assert set(before) == {"0", "1"}
    with ThreadPoolExecutor(4) as pool:  # a burst of 4: two to each core while they overlap
        list(pool.map(lambda p: _complete(server, p), PROMPTS[:4]))
    after = server.successes_per_engine()
    done = {engine: after[engine] - before[engine] for engine in after}
    assert done["0"] > 0 and done["1"] > 0 and sum(done.values()) == 4, done
    page = httpx.get(server.url + "/metrics").text
    blocks = dict(re.findall(r'vllm:cache_config_info\{.*engine="(\d)".*num_gpu_blocks="(\d+)"', page))
    assert set(blocks) == {"0", "1"} and all(int(n) > 0 for n in blocks.values())  # each core's own
    assert len(servers["dp1"].successes_per_engine()) == 1  # one core: engine="0" alone


def test_a_chat_without_max_tokens_stops_by_itself(servers: dict[str, ServerProcess]) -> None:
    question = "What is the capital of France? Answer in one sentence."
    text, finish_reason = _chat(servers["dp2"], question, max_tokens=None)
    assert finish_reason == "stop" and "Paris" in text
    assert (text, finish_reason) == _chat(servers["dp1"], question, max_tokens=None)


def test_a_dead_core_kills_the_engine_and_the_server_exits_non_zero() -> None:
    server = ServerProcess(*DP2).wait_ready()
    try:
        pids = _core_pids(server)
        assert sorted(pids) == [0, 1], server.log()
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)  # the stream runs on core 0 (both idle: the lower index)
            psutil.Process(pids[1]).send_signal(signal.SIGKILL)  # the idle core
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]  # core 0's request fails too
        assert error["code"] == "engine_dead" and rest[-1] == "data: [DONE]"
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_dead"
        assert "engine core 1 process exited with code -9" in health.json()["error"]["message"]
        rc = server.proc.wait(timeout=15)
        assert rc != 0 and time.monotonic() - killed < 15
        assert all(_gone(pid) for pid in pids.values())  # the live core stopped, the dead one reaped
    finally:
        server.stop()


def test_sigterm_stops_every_core_and_exits_0() -> None:
    server = ServerProcess(*DP2).wait_ready()
    try:
        pids = _core_pids(server)
        assert sorted(pids) == [0, 1], server.log()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 0, server.log()
        assert all(_gone(pid) for pid in pids.values())
    finally:
        server.stop()


def test_a_core_that_fails_to_start_fails_start_up_with_its_error() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    bind = f"{allowed[0]}|{allowed[-1] + 1}"  # core 1's CPU is not one it may use
    server = ServerProcess(*DP2, "--omp-threads-bind", bind)
    rc = server.proc.wait(timeout=120)
    log = server.log()
    server.stop()
    assert rc == 1, log
    assert "engine core 1 failed to start" in log
    assert f"CPU {allowed[-1] + 1} is not one this process may use" in log


def test_data_parallel_rank_is_the_servers_to_set() -> None:
    stderr = serve_usage_error("--data-parallel-size", "2", "--data-parallel-rank", "1")
    assert "--data-parallel-rank" in stderr and "not implemented" in stderr
