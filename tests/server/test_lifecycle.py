"""Start-up, load shedding, SIGTERM and engine death, each on its own server process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
from conftest import ServerProcess

LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_health_is_never_200_before_ready_and_queue_is_bounded() -> None:
    server = ServerProcess("--max-num-seqs", "2", "--max-waiting-requests", "1")
    try:
        codes = _health_until_200(server)
        assert f"axon serving SmolLM2-135M-Instruct at http://127.0.0.1:{server.port}" in server.log()
        assert set(codes) <= {"refused", 503}
        body = {**LONG_STREAM, "max_tokens": 48}
        with ThreadPoolExecutor(6) as pool:
            responses = list(
                pool.map(
                    lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=60), range(6)
                )
            )
        ok = [r for r in responses if r.status_code == 200]
        shed = [r for r in responses if r.status_code == 503]
        assert len(ok) == 3 and len(shed) == 3  # 2 running + 1 waiting
        for r in shed:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "server_overloaded"
        assert all(r.json()["usage"]["completion_tokens"] == 48 for r in ok)
        after = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
        assert after.status_code == 200
    finally:
        server.stop()


def _health_until_200(server: ServerProcess) -> list[int | str]:
    codes: list[int | str] = []
    while True:
        try:
            code = httpx.get(server.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            code = "refused"
        if code == 200:
            return codes
        assert server.proc.poll() is None, server.log()
        codes.append(code)
        time.sleep(0.1)


def test_sigterm_aborts_in_flight_and_exits_0() -> None:
    server = ServerProcess().wait_ready()
    non_streaming: dict = {}

    def post() -> None:
        r = httpx.post(server.url + "/v1/completions", json=LONG_STREAM, timeout=30)
        non_streaming.update(r.json())

    thread = threading.Thread(target=post)
    thread.start()
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG_STREAM, "stream": True}) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 6:
                server.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    thread.join(timeout=10)
    rc = server.proc.wait(timeout=10)
    elapsed = time.monotonic() - sent
    server.stop()
    assert rc == 0 and elapsed < 8, server.log()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert non_streaming["choices"][0]["finish_reason"] == "abort"
    assert 0 < non_streaming["usage"]["completion_tokens"] < 400


def test_engine_death_turns_health_503_and_exits_non_zero() -> None:
    server = ServerProcess().wait_ready()
    try:
        core = _engine_core_child(server.proc.pid)
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG_STREAM, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            core.send_signal(signal.SIGKILL)
            # From the kill on, /health is 200 (not yet delivered) or names the dead engine; never
            # "still loading" (it once did for the 0.5 s the watcher took to notice).
            codes = [_health_code(server)]
            while codes[-1] != "engine_dead" and len(codes) < 200:
                codes.append(_health_code(server))
            assert set(codes) <= {"200", "engine_dead"} and codes[-1] == "engine_dead", codes
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"  # the stream says why it ended
        error = json.loads(rest[-2].removeprefix("data: "))["error"]  # the shape of a non-streamed error
        assert (
            error["code"] == "engine_dead"
            and error["type"] == "server_error"
            and "error id" in error["message"]
        )
        assert httpx.get(server.url + "/health").status_code == 503
        rc = server.proc.wait(timeout=10)
        assert rc != 0
        assert "the engine core process exited with code -9" in server.log()
    finally:
        server.stop()


def _health_code(server: ServerProcess) -> str:
    r = httpx.get(server.url + "/health", timeout=5)
    return "200" if r.status_code == 200 else r.json()["error"]["code"]


def _engine_core_child(pid: int) -> psutil.Process:
    children = psutil.Process(pid).children(recursive=True)
    cores = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(cores) == 1, [c.cmdline() for c in children]
    return cores[0]


def test_bad_engine_flag_exits_2_without_serving() -> None:
    cmd = [sys.executable, "-m", "axon.entrypoints.cli", "serve", "--max-model-len", "999999"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "max_model_len 999999 exceeds" in r.stderr


FAULT_ENV = {"AXON_FAULT_INJECT_FAIL_AT_STEP": "4"}  # read by the engine core (core_proc.py)


def _stream_until_end(server: ServerProcess, max_tokens: int = 400) -> list[str]:
    body = {**LONG_STREAM, "stream": True, "max_tokens": max_tokens}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        return [line for line in r.iter_lines() if line.startswith("data: ")]


def _assert_named_dead_and_reaped(server: ServerProcess, core: psutil.Process) -> None:
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503
    error = health.json()["error"]
    assert error["code"] == "engine_dead" and "fault injected at step 4" in error["message"]
    assert "Traceback" not in error["message"] and ".py" not in error["message"]
    _wait_for(lambda: not psutil.pid_exists(core.pid), 5)  # exited and reaped: no zombie


def test_engine_exception_exits_non_zero_without_zombie() -> None:
    server = ServerProcess(env=FAULT_ENV).wait_ready()
    try:
        core = _engine_core_child(server.proc.pid)
        events = _stream_until_end(server)
        died = time.monotonic()
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        assert "Traceback" not in events[-2]
        _assert_named_dead_and_reaped(server, core)
        rc = server.proc.wait(timeout=15)  # the grace (2 s), then a bounded shutdown
        assert rc == 1 and time.monotonic() - died < 12, server.log()
        assert "fault injected at step 4" in server.log()
    finally:
        server.stop()


def test_sigterm_while_engine_is_dead_exits_at_once() -> None:
    server = ServerProcess(env=FAULT_ENV).wait_ready()
    try:
        core = _engine_core_child(server.proc.pid)
        _stream_until_end(server)
        _assert_named_dead_and_reaped(server, core)
        server.proc.send_signal(signal.SIGTERM)  # within the 2 s grace
        assert server.proc.wait(timeout=10) == 1, server.log()
    finally:
        server.stop()


def test_stopped_engine_turns_health_503_then_recovers() -> None:
    server = ServerProcess("--engine-heartbeat-timeout", "3").wait_ready()
    try:
        core = _engine_core_child(server.proc.pid)
        with ThreadPoolExecutor(1) as pool:
            events = pool.submit(_stream_until_end, server, 48)
            _stop_and_resume(server, core)
            last = json.loads(events.result(timeout=300)[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "length"
        # Stopped again, SIGTERM still ends the server in seconds: shutdown kills and reaps the core.
        core.send_signal(signal.SIGSTOP)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert server.proc.wait(timeout=15) == 0 and time.monotonic() - sent < 12, server.log()
        assert not psutil.pid_exists(core.pid)  # killed and reaped
    finally:
        server.stop()


def _stop_and_resume(server: ServerProcess, core: psutil.Process) -> None:
    """While a request runs: SIGSTOP the core -> /health 503 engine_stalled; SIGCONT -> 200."""
    _wait_for(lambda: server.metric("vllm:num_requests_running") == 1, 30)
    core.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    health = _wait_for(lambda: _health_if(server, 503), 15)
    assert 2 <= time.monotonic() - stopped < 12  # the 3 s bound counts from the last message
    assert health.json()["error"]["code"] == "engine_stalled"
    assert "has not answered" in health.json()["error"]["message"]
    core.send_signal(signal.SIGCONT)
    _wait_for(lambda: _health_if(server, 200), 10)


def _health_if(server: ServerProcess, code: int) -> httpx.Response | None:
    r = httpx.get(server.url + "/health", timeout=5)
    return r if r.status_code == code else None


def _wait_for(check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s")
