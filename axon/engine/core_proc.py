"""The engine-core process: EngineCore behind two ZMQ sockets, as in vLLM V1.

    front end (server process)                 engine-core process
    PUSH --(ADD / ABORT / SHUTDOWN)--> input   PULL   loop: drain input, step, send outputs
    PULL <--(OUTPUTS / READY / DEAD)-- output  PUSH

Messages are msgspec-encoded ``(kind, payload)`` pairs. The loop blocks on the input socket
only while idle, so HTTP work in the front end never stalls the model, and the model never
waits on HTTP. An exception in a step is reported as DEAD with its traceback, then the
process exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import Any

import msgspec
import zmq

from axon.config import AxonConfig
from axon.engine.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

ADD, ABORT, SHUTDOWN = b"ADD", b"ABORT", b"SHUTDOWN"
READY, OUTPUTS, DEAD = b"READY", b"OUTPUTS", b"DEAD"

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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    logging.basicConfig(
        level=os.environ.get("AXON_LOG_LEVEL", "INFO"),
        format="%(levelname)s %(asctime)s [engine-core] %(message)s",
    )
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    try:
        from axon.engine.core import EngineCore

        core = EngineCore(config)
        out.send_multipart(encode(READY, {"num_blocks": core.num_blocks, "pid": os.getpid()}))
        _loop(core, inp, out)
    except Exception:  # noqa: BLE001 (any failure must reach the front end as DEAD)
        error = traceback.format_exc()
        logger.error("engine core died:\n%s", error)
        out.send_multipart(encode(DEAD, error))
        out.close(linger=2000)
        raise SystemExit(1) from None
    out.close(linger=1000)


def _loop(core: Any, inp: zmq.Socket, out: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
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
            elif kind == ABORT:
                core.abort_requests(msgspec.msgpack.decode(payload))
                # Report the freed KV at once, even if no step follows.
                out.send_multipart(
                    encode(OUTPUTS, EngineCoreOutputs(outputs=[], scheduler_stats=core.make_stats()))
                )
            timeout = 0
        if core.has_unfinished_requests():
            out.send_multipart(encode(OUTPUTS, core.step()))
