"""Multi-host data parallelism (vLLM's ``--headless``, ``--data-parallel-size-local``,
``--data-parallel-start-rank``, ``--data-parallel-address``, ``--data-parallel-rpc-port``)
through real processes on 127.0.0.1: a head with one engine core of its own and a headless
"host" with the other, joined over tcp (axon/engine/dp_handshake.py). The head is healthy only
once the remote core joined, both ranks answer with the very tokens one core gives and report
under their ``engine`` label, a bad join is refused on both sides, SIGTERM on the head stops
the headless host with exit 0, and a killed headless host kills the engine within the
heartbeat timeout. The one-host cases are tests/server/test_data_parallel.py.

Thread pinning: a core pins by its data-parallel rank (axon/worker/worker.py), today the global
rank among data_parallel_size, and by the index among this host's cores once the worker reads
--data-parallel-size-local; no one list of CPU groups suits both, so the cores here run one
unpinned thread each (the same under either rule).
"""

from __future__ import annotations

import re
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import psutil
import pytest
from conftest import COMPLETION_PROMPTS as PROMPTS
from conftest import ServerProcess, free_port, serve_usage_error

from axon.config import ParallelConfig
from axon.engine.dp_handshake import (
    CoreAddresses,
    CoreExited,
    FromHead,
    HandshakeError,
    HeadLink,
    JoinReply,
    JoinRequest,
    Ping,
    Pong,
    ToHead,
)
from axon.entrypoints.cli import EXIT_USAGE, main

HEARTBEAT_TIMEOUT_S = 5.0


def _dp_args(rpc_port: int, cpu: int) -> tuple[str, ...]:
    """The two "hosts" share this machine: each pins its one core to its own CPU."""
    return (
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
        "--omp-threads-bind",
        str(cpu),
    )


def _head(rpc_port: int, *extra: str) -> ServerProcess:
    return ServerProcess(*_dp_args(rpc_port, 0), *extra)


def _headless(rpc_port: int, start_rank: int = 1) -> ServerProcess:
    """``axon serve --headless`` (its --port, from ServerProcess, goes unused)."""
    return ServerProcess("--headless", *_dp_args(rpc_port, 1), "--data-parallel-start-rank", str(start_rank))


def _wait_for_log(proc: ServerProcess, pattern: str, timeout_s: float = 120.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, proc.log())
        if found:
            return found
        if proc.proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.proc.returncode} before {pattern!r}:\n{proc.log()}")
        time.sleep(0.2)
    raise RuntimeError(f"no {pattern!r} in {timeout_s} s:\n{proc.log()}")


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, object]]:
    """A one-core server (the reference), and a head whose own core is up while rank 1 has not
    joined: /health then, and then the headless host that joins it."""
    rpc_port = free_port()
    started = {"dp1": ServerProcess(), "head": _head(rpc_port)}
    try:
        _wait_for_log(started["head"], r"engine core 0 ready")
        health_alone = httpx.get(started["head"].url + "/health", timeout=5)
        started["headless"] = _headless(rpc_port)
        for name in ("dp1", "head"):
            started[name].wait_ready()
        yield {**started, "health_alone": health_alone, "rpc_port": rpc_port}
    finally:
        for proc in started.values():
            proc.stop()


def _complete(server: ServerProcess, prompt: str) -> tuple[str, str]:
    client = server.client()
    reply = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, temperature=0, max_tokens=12
    )
    return reply.choices[0].text, reply.choices[0].finish_reason


def _all_at_once(server: ServerProcess) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _complete(server, p), PROMPTS))


def _chat(server: ServerProcess, question: str) -> tuple[str, str]:
    client = server.client()
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": question}],
        temperature=0,
    )
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def test_the_head_is_healthy_only_once_the_remote_core_joined(hosts: dict) -> None:
    head, headless = hosts["head"], hosts["headless"]
    assert hosts["health_alone"].status_code == 503
    assert hosts["health_alone"].json()["error"]["code"] == "model_not_ready"
    log = head.log()
    waiting = log.index("waiting for the engine cores of ranks 1..1 to join at tcp://127.0.0.1:")
    joined = re.search(r"engine core 1 joined from \S+: input tcp://127\.0\.0\.1:\d+, output tcp://", log)
    assert joined and waiting < joined.start() < log.index("axon serving"), log
    assert re.search(r"engine core 1 ready: pid \d+ on \S+", log)
    assert "engine core 1 joined the head: pid" in headless.log()
    assert "Uvicorn" not in headless.log() and "listening on" not in headless.log()  # no HTTP server


def test_16_concurrent_greedy_completions_get_the_tokens_one_core_gives(hosts: dict) -> None:
    one_core = _all_at_once(hosts["dp1"])
    two_hosts = _all_at_once(hosts["head"])
    assert all(text for text, _ in one_core)
    for prompt, got, want in zip(PROMPTS, two_hosts, one_core, strict=True):
        assert got == want, f"{prompt!r}: {got!r} across two hosts, {want!r} on one core"


def test_both_ranks_report_finished_requests_under_their_engine_label(hosts: dict) -> None:
    head = hosts["head"]
    before = head.successes_per_engine()
    with ThreadPoolExecutor(4) as pool:  # a burst of 4: two to each core while they overlap
        list(pool.map(lambda p: _complete(head, p), PROMPTS[:4]))
    after = head.successes_per_engine()
    assert set(after) == {"0", "1"}
    done = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    assert done["0"] > 0 and done["1"] > 0 and sum(done.values()) == 4, done
    page = httpx.get(head.url + "/metrics").text
    blocks = dict(re.findall(r'vllm:cache_config_info\{.*engine="(\d)".*num_gpu_blocks="(\d+)"', page))
    assert set(blocks) == {"0", "1"} and all(int(n) > 0 for n in blocks.values())


def test_a_chat_without_max_tokens_stops_by_itself(hosts: dict) -> None:
    question = "What is the capital of France? Answer in one sentence."
    text, finish_reason = _chat(hosts["head"], question)
    assert finish_reason == "stop" and "Paris" in text
    assert (text, finish_reason) == _chat(hosts["dp1"], question)


@pytest.mark.parametrize(
    ("ranks", "size", "refusal"),
    [
        ([1], 2, r"rank 1 has already joined \(from \S+\)"),
        ([0], 2, r"rank 0 is one of the head's own engine cores \(ranks 0\.\.0"),
        ([2], 2, r"rank 2 is out of range: --data-parallel-size 2 has ranks 0\.\.1"),
        ([1], 3, r"the head runs --data-parallel-size 2, joiner was given 3"),
    ],
)
def test_a_bad_join_is_refused_on_both_sides(hosts: dict, ranks: list[int], size: int, refusal: str) -> None:
    parallel = ParallelConfig(data_parallel_size=size, data_parallel_rpc_port=hosts["rpc_port"])
    link = HeadLink(parallel, "joiner")
    try:
        with pytest.raises(
            HandshakeError, match=r"the head at tcp://127\.0\.0\.1:\d+ refused ranks .*" + refusal
        ):
            link.join(ranks, timeout_s=10)
    finally:
        link.close()
    assert re.search(rf"refused engine cores \[{ranks[0]}\] of joiner: {refusal}", hosts["head"].log())
    assert httpx.get(hosts["head"].url + "/health").status_code == 200  # the engine is untouched


def test_a_second_headless_host_for_a_joined_rank_exits_1(hosts: dict) -> None:
    second = _headless(hosts["rpc_port"])
    try:
        assert second.proc.wait(timeout=60) == 1
        assert re.search(r"refused ranks \[1\]: rank 1 has already joined", second.log()), second.log()
        assert "engine core 1 joined the head" not in second.log()
    finally:
        second.stop()


def test_sigterm_on_the_head_stops_the_headless_host_with_exit_0(hosts: dict) -> None:
    head, headless = hosts["head"], hosts["headless"]
    core_pid = int(re.search(r"engine core 1 joined the head: pid (\d+)", headless.log()).group(1))
    head.proc.send_signal(signal.SIGTERM)
    assert head.proc.wait(timeout=15) == 0, head.log()
    assert headless.proc.wait(timeout=10) == 0, headless.log()
    assert "the head stopped every engine core of this host" in headless.log()
    assert not psutil.pid_exists(core_pid) or psutil.Process(core_pid).status() == psutil.STATUS_ZOMBIE


def test_a_killed_headless_host_kills_the_engine_and_the_head_exits_non_zero() -> None:
    rpc_port = free_port()
    head = _head(rpc_port, "--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    headless = _headless(rpc_port)
    try:
        head.wait_ready()
        headless.proc.send_signal(signal.SIGKILL)  # its core dies with it (core_proc.py)
        killed = time.monotonic()
        deadline = killed + HEARTBEAT_TIMEOUT_S + 10
        while (health := httpx.get(head.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "the head still reports healthy"
            time.sleep(0.2)
        assert health.status_code == 503
        error = health.json()["error"]
        assert error["code"] == "engine_dead", error
        assert re.search(r"engine core 1 on \S+ has not been heard for \d+ s", error["message"]), error
        rc = head.proc.wait(timeout=15)
        assert rc != 0 and time.monotonic() - killed < HEARTBEAT_TIMEOUT_S + 15, head.log()
    finally:
        headless.stop()
        head.stop()


def test_an_unreachable_head_fails_the_join_naming_its_address() -> None:
    rpc_port = free_port()  # nobody listens there
    link = HeadLink(ParallelConfig(data_parallel_size=2, data_parallel_rpc_port=rpc_port), "joiner")
    try:
        with pytest.raises(
            HandshakeError, match=rf"the head at tcp://127\.0\.0\.1:{rpc_port} did not answer"
        ):
            link.join([1], timeout_s=1.0)  # the headless host waits the start-up timeout
    finally:
        link.close()


def test_a_head_whose_rpc_port_is_taken_fails_to_start_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rpc_port = taken.getsockname()[1]
        head = _head(rpc_port)
        try:
            assert head.proc.wait(timeout=120) == 1, head.log()
            log = head.log()
        finally:
            head.stop()
    assert f"cannot listen for remote engine cores at tcp://127.0.0.1:{rpc_port}" in log, log


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--headless", "--data-parallel-size", "2"), "--data-parallel-size-local"),
        (
            ("--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1")
            + ("--data-parallel-start-rank", "2"),
            "data_parallel_start_rank",
        ),
        (("--data-parallel-size", "2", "--data-parallel-size-local", "3"), "data_parallel_size_local"),
        (("--data-parallel-size", "2", "--data-parallel-start-rank", "1"), "--data-parallel-start-rank"),
        (("--data-parallel-rpc-port", "70000"), "data_parallel_rpc_port"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_option(
    flags: tuple[str, ...], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == EXIT_USAGE  # before any model is read
    stderr = capsys.readouterr().err
    assert stderr.startswith("axon serve: error: ") and named in stderr, stderr


def test_a_headless_host_without_its_core_count_exits_2_with_no_traceback() -> None:
    stderr = serve_usage_error("--headless", "--data-parallel-size", "2")
    assert "--headless needs --data-parallel-size-local" in stderr


@pytest.mark.parametrize(
    "record",
    [
        JoinRequest(ranks=[1, 2], data_parallel_size=4, host="node-1"),
        Ping(ranks=[3]),
        CoreExited(rank=2, reason="its process exited with code -9"),
    ],
)
def test_messages_to_the_head_round_trip(record: ToHead) -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=ToHead) == record


@pytest.mark.parametrize(
    "record",
    [
        JoinReply(addresses={1: CoreAddresses("tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002")}),
        JoinReply(error="rank 1 has already joined (from node-1)"),
        Pong(),
        Pong(error="this head has no joined engine core of rank 3"),
    ],
)
def test_messages_from_the_head_round_trip(record: FromHead) -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=FromHead) == record
