"""The engine-core process: EngineCore behind two ZMQ sockets, as in vLLM V1.

    front end (server process)                 engine-core process
    PUSH --(ADD / ABORT / UTILITY /    input   PULL   loop: drain input, step, send outputs
            SHUTDOWN)------------->
    PULL <--(OUTPUTS / READY / DEAD /  output  PUSH
            UTILITY)---------------
         <--(HEARTBEAT)--------------- output  PUSH   (its own socket, on a heartbeat thread)

Messages are msgspec-encoded ``(kind, payload)`` pairs. The loop blocks on the input socket
only while idle, so HTTP work in the front end never stalls the model, and the model never
waits on HTTP. An exception in a step is reported as DEAD with its traceback, then the
process exits non-zero.

The heartbeat thread sends HEARTBEAT every ``HEARTBEAT_INTERVAL_S`` whatever the loop is doing
(a forward releases the GIL, and a long compile yields it every switch interval), so a front
end that hears nothing for many intervals knows the process is frozen (stopped, swapped out,
deadlocked holding the GIL), not merely busy with a long step.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from axon.config import AxonConfig
from axon.engine.messages import EngineCoreOutputs, EngineCoreRequest
from axon.platforms.processes import die_with_parent
from axon.startup import configure_logging, freeze_start_up_heap

logger = logging.getLogger(__name__)

ADD, ABORT, SHUTDOWN, UTILITY = b"ADD", b"ABORT", b"SHUTDOWN", b"UTILITY"
READY, OUTPUTS, DEAD, HEARTBEAT = b"READY", b"OUTPUTS", b"DEAD", b"HEARTBEAT"
# The engine core's methods the front end may call between steps (UTILITY [call id, method, args]),
# each answered with UTILITY [call id, result].
UTILITY_METHODS = frozenset(
    {"reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "start_profile", "stop_profile"}
)
HEARTBEAT_INTERVAL_S = 1.0
# Silence after which the front end calls the core stalled: many missed heartbeats, so a busy
# machine or a long compile (which still lets the heartbeat thread run) does not trip it.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
# Fault injection for the server's failure-path tests only: the engine core raises in its Nth
# step (N = the variable's value), as a bug in a step would. Never set in production.
FAULT_INJECT_STEP_ENV = "AXON_FAULT_INJECT_FAIL_AT_STEP"

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


def encode(kind: bytes, payload: Any) -> list[bytes]:
    return [kind, _encoder.encode(payload)]


def decode_outputs(frame: bytes) -> EngineCoreOutputs:
    return _outputs_decoder.decode(frame)


def decode_request(frame: bytes) -> EngineCoreRequest:
    return _request_decoder.decode(frame)


def run_engine_core(config: AxonConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the engine-core process (started with the spawn method)."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid)  # a killed front end leaves no engine behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    configure_logging("engine-core")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    stop_heartbeat = _start_heartbeat(ctx, output_addr)
    code = 0
    try:
        from axon.engine.core import make_engine_core

        core = make_engine_core(config)
        freeze_start_up_heap()
        out.send_multipart(encode(READY, {"num_blocks": core.num_blocks, "pid": os.getpid()}))
        _loop(core, inp, out, _step_function(core))
        core.shutdown()
    except Exception:  # noqa: BLE001 (any failure must reach the front end as DEAD)
        error = traceback.format_exc()
        logger.error("engine core died:\n%s", error)
        with contextlib.suppress(zmq.Again):  # a front end that is gone cannot be told
            out.send_multipart(encode(DEAD, error), flags=zmq.NOBLOCK)
        code = 1
    stop_heartbeat()
    inp.close(linger=0)
    out.close(linger=2000)  # bounded: the front end may be gone
    ctx.term()
    if code != 0:
        # Exit at once: a thread of the failed core (the async-scheduling worker, stuck in the
        # step that failed) must not keep a dead engine's process alive at interpreter exit.
        logging.shutdown()
        os._exit(code)


def _start_heartbeat(ctx: zmq.Context, output_addr: str) -> Callable[[], None]:
    """Send HEARTBEAT on a socket of its own (sockets are not thread-safe); returns ``stop``."""
    stopped = threading.Event()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(output_addr)

    def beat() -> None:
        while not stopped.wait(HEARTBEAT_INTERVAL_S):
            with contextlib.suppress(zmq.Again):  # no front end to hear it: nothing to tell
                sock.send_multipart([HEARTBEAT, b""], flags=zmq.NOBLOCK)
        sock.close(linger=0)

    thread = threading.Thread(target=beat, name="axon-heartbeat", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)

    return stop


def _step_function(core: Any) -> Callable[[], EngineCoreOutputs]:
    """``core.step``, or with ``AXON_FAULT_INJECT_FAIL_AT_STEP=N`` a step that raises at the Nth call."""
    fail_at = os.environ.get(FAULT_INJECT_STEP_ENV)
    if not fail_at:
        return core.step
    calls = 0

    def step() -> EngineCoreOutputs:
        nonlocal calls
        calls += 1
        if calls == int(fail_at):
            raise RuntimeError(f"fault injected at step {calls} ({FAULT_INJECT_STEP_ENV})")
        return core.step()

    return step


def _loop(core: Any, inp: zmq.Socket, out: zmq.Socket, step: Callable[[], EngineCoreOutputs]) -> None:
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
        core.check_health()  # a worker process that died while the engine was idle
        # Idle: compile the buckets traffic reached, then wait for work. Busy: only drain
        # what has already arrived.
        idle = not core.has_unfinished_requests()
        if idle and not poller.poll(0) and core.compile_pending():
            out.send_multipart(
                encode(OUTPUTS, EngineCoreOutputs(outputs=[], scheduler_stats=core.make_stats()))
            )
        timeout = 0 if core.has_unfinished_requests() else 1000
        while poller.poll(timeout):
            kind, payload = inp.recv_multipart()
            if kind == SHUTDOWN:
                return
            if kind == ADD:
                core.add_request(decode_request(payload))
            elif kind == UTILITY:
                call_id, method, args = msgspec.msgpack.decode(payload)
                assert method in UTILITY_METHODS, f"not a utility method: {method!r}"
                out.send_multipart(encode(UTILITY, [call_id, getattr(core, method)(*args)]))
            elif kind == ABORT:
                core.abort_requests(msgspec.msgpack.decode(payload))
                # Report the freed KV at once, even if no step follows.
                out.send_multipart(
                    encode(OUTPUTS, EngineCoreOutputs(outputs=[], scheduler_stats=core.make_stats()))
                )
            timeout = 0
        if core.has_unfinished_requests():
            out.send_multipart(encode(OUTPUTS, step()))
