"""How engine cores on other hosts join the front end: vLLM's multi-node data parallelism
(``--data-parallel-size N --data-parallel-size-local L`` on the head, ``axon serve --headless``
with ``--data-parallel-start-rank S`` on each other host).

    head (axon serve)                                   headless host (axon serve --headless)
    ROUTER tcp://ADDR:PORT <--JoinRequest(ranks, N, host)-- DEALER  (once, for all its ranks)
                           --JoinReply(addresses | error)->
                           <--Ping(ranks)------------------ every HEARTBEAT_INTERVAL_S
                           --Pong(error)------------------>
                           <--CoreExited(rank, reason)----- a core of its ended without SHUTDOWN

Before it listens, the head binds each remote rank's input PUSH and output PULL on
tcp://ADDR:(a free port) (``RemoteEngineCore``); a join is answered with those addresses, and
the headless host starts ``run_engine_core(config, input_addr, output_addr)`` on them, the loop
of a local core unchanged: READY, OUTPUTS, DEAD, HEARTBEAT and SHUTDOWN as on one host.

A join is all or nothing: a rank out of range, one of the head's own (0..L-1), one already
joined, or a different ``data_parallel_size`` refuses the whole request, and both sides log
why. Liveness runs both ways: the head hears each remote core's heartbeats (silence past
``--engine-heartbeat-timeout`` is its death: there is no local process to watch), and the
headless host hears the head's pongs (silence past its own timeout: the head is gone, and it
stops its cores). A pong carrying an error (a restarted head that never met these ranks)
ends the headless host too. Nothing is authenticated: the ports belong on a trusted network,
as vLLM's do.
"""

from __future__ import annotations

import contextlib
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from axon.config import ParallelConfig
from axon.engine.core_client import RemoteEngineCore

logger = logging.getLogger(__name__)


class JoinRequest(msgspec.Struct, tag="join"):
    ranks: list[int]  # global ranks of the joining host's engine cores
    data_parallel_size: int  # as that host was told, checked against the head's
    host: str  # its name, for messages


class CoreAddresses(msgspec.Struct):
    input_addr: str  # tcp://ADDR:port of the head's PUSH; the core's PULL connects
    output_addr: str  # tcp://ADDR:port of the head's PULL; the core's PUSHes connect


class JoinReply(msgspec.Struct, tag="joined"):
    addresses: dict[int, CoreAddresses] = {}  # rank -> its sockets; empty when refused
    error: str | None = None


class Ping(msgspec.Struct, tag="ping"):
    ranks: list[int]


class Pong(msgspec.Struct, tag="pong"):
    error: str | None = None  # the head does not know these ranks


class CoreExited(msgspec.Struct, tag="exited"):
    rank: int
    reason: str  # "its process exited with code -9", "stopped by SIGTERM on its host"


ToHead = JoinRequest | Ping | CoreExited
FromHead = JoinReply | Pong

_encoder = msgspec.msgpack.Encoder()
_to_head = msgspec.msgpack.Decoder(ToHead)
_from_head = msgspec.msgpack.Decoder(FromHead)


def join_endpoint(parallel: ParallelConfig) -> str:
    return f"tcp://{parallel.data_parallel_address}:{parallel.data_parallel_rpc_port}"


class HandshakeError(RuntimeError):
    """The head is unreachable, refused the join, or stopped answering."""


# ---- the head's end --------------------------------------------------------------------------
class HandshakeServer:
    """Listens at ``join_endpoint`` for the hosts of ``remote`` (rank -> its core, bound) and
    answers their joins, pings and exit reports until closed."""

    def __init__(
        self, ctx: zmq.asyncio.Context, parallel: ParallelConfig, remote: dict[int, RemoteEngineCore]
    ) -> None:
        self.endpoint = join_endpoint(parallel)
        self.data_parallel_size = parallel.data_parallel_size
        self.num_local = parallel.data_parallel_size - len(remote)
        self.remote = remote
        self.socket = ctx.socket(zmq.ROUTER)

    def bind(self) -> None:
        try:
            self.socket.bind(self.endpoint)
        except zmq.ZMQError as e:
            raise HandshakeError(
                f"cannot listen for remote engine cores at {self.endpoint} (--data-parallel-address, "
                f"--data-parallel-rpc-port): {e}"
            ) from None
        first, last = min(self.remote), max(self.remote)
        logger.info(
            "waiting for the engine cores of ranks %d..%d to join at %s (axon serve --headless on "
            "their hosts)",
            first,
            last,
            self.endpoint,
        )

    async def serve(self) -> None:
        while True:
            parts = await self.socket.recv_multipart()
            try:
                identity, frame = parts
                message = _to_head.decode(frame)
            except (ValueError, msgspec.DecodeError) as e:
                logger.warning("ignored a message at %s that is not a handshake: %s", self.endpoint, e)
                continue
            reply = self._answer(message)
            if reply is not None:
                await self.socket.send_multipart([identity, _encoder.encode(reply)])

    def close(self) -> None:
        self.socket.close(linger=0)

    def _answer(self, message: ToHead) -> FromHead | None:
        if isinstance(message, JoinRequest):
            return self._join(message)
        if isinstance(message, Ping):
            unknown = [r for r in message.ranks if r not in self.remote or self.remote[r].host is None]
            return Pong(f"this head has no joined engine core of rank {unknown[0]}" if unknown else None)
        core = self.remote.get(message.rank)
        if core is not None and core.exit_report is None:
            logger.error("%s on %s: %s", core.name, core.host, message.reason)
            core.exit_report = message.reason
        return None

    def _join(self, request: JoinRequest) -> JoinReply:
        refusal = self._refusal(request)
        if refusal is not None:
            logger.error("refused engine cores %s of %s: %s", request.ranks, request.host, refusal)
            return JoinReply(error=refusal)
        addresses = {}
        for rank in request.ranks:
            core = self.remote[rank]
            core.host, core.last_heard = request.host, time.monotonic()
            addresses[rank] = CoreAddresses(core.input_addr, core.output_addr)
            logger.info(
                "%s joined from %s: input %s, output %s",
                core.name,
                request.host,
                core.input_addr,
                core.output_addr,
            )
        return JoinReply(addresses=addresses)

    def _refusal(self, request: JoinRequest) -> str | None:
        size, num_local = self.data_parallel_size, self.num_local
        if request.data_parallel_size != size:
            return (
                f"the head runs --data-parallel-size {size}, {request.host} was given "
                f"{request.data_parallel_size}"
            )
        if not request.ranks:
            return "no ranks to join"
        for rank in request.ranks:
            if not 0 <= rank < size:
                return f"rank {rank} is out of range: --data-parallel-size {size} has ranks 0..{size - 1}"
            if rank < num_local:
                return (
                    f"rank {rank} is one of the head's own engine cores (ranks 0..{num_local - 1}, "
                    f"--data-parallel-size-local {num_local})"
                )
            if request.ranks.count(rank) > 1:
                return f"rank {rank} is named twice"
            if self.remote[rank].host is not None:
                return f"rank {rank} has already joined (from {self.remote[rank].host})"
        return None


# ---- a headless host's end -------------------------------------------------------------------
class HeadLink:
    """A headless host's connection to the head's handshake port (blocking; one thread)."""

    def __init__(self, parallel: ParallelConfig, host: str) -> None:
        self.endpoint = join_endpoint(parallel)
        self.data_parallel_size = parallel.data_parallel_size
        self.host = host
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.connect(self.endpoint)

    def join(self, ranks: list[int], timeout_s: float) -> dict[int, CoreAddresses]:
        """Each rank's socket addresses on the head; HandshakeError if it refuses or is silent."""
        self._socket.send(_encoder.encode(JoinRequest(ranks, self.data_parallel_size, self.host)))
        if not self._socket.poll(int(timeout_s * 1000)):
            raise HandshakeError(
                f"the head at {self.endpoint} did not answer within {timeout_s:.0f} s: is `axon serve "
                f"--data-parallel-size {self.data_parallel_size}` running there, listening on this "
                "address (--data-parallel-address, --data-parallel-rpc-port)?"
            )
        reply = _from_head.decode(self._socket.recv())
        if not isinstance(reply, JoinReply) or reply.error is not None:
            error = reply.error if isinstance(reply, JoinReply) else f"unexpected reply {reply!r}"
            raise HandshakeError(f"the head at {self.endpoint} refused ranks {ranks}: {error}")
        return reply.addresses

    def ping(self, ranks: list[int]) -> None:
        with contextlib.suppress(zmq.Again):  # the queue to a silent head is full: it is late
            self._socket.send(_encoder.encode(Ping(ranks)), flags=zmq.NOBLOCK)

    def wait_pong(self, timeout_s: float) -> bool:
        """True if a pong came within ``timeout_s``; HandshakeError if the head disowns us."""
        if not self._socket.poll(int(timeout_s * 1000)):
            return False
        got = False
        while self._socket.poll(0):
            reply = _from_head.decode(self._socket.recv())
            if isinstance(reply, Pong) and reply.error is not None:
                raise HandshakeError(f"the head at {self.endpoint} answered: {reply.error}")
            got = got or isinstance(reply, Pong)
        return got

    def report_exit(self, rank: int, reason: str) -> None:
        with contextlib.suppress(zmq.Again):  # a head that is gone cannot be told
            self._socket.send(_encoder.encode(CoreExited(rank, reason)), flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close(linger=500)  # exit reports leave if the head is there to take them
        self._ctx.term()
