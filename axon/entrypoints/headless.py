"""``axon serve --headless``: this host runs engine cores only, global ranks S..S+L-1
(``--data-parallel-start-rank``, ``--data-parallel-size-local``) of an engine whose head, ``axon
serve --data-parallel-size N`` on ``--data-parallel-address``, runs the API server.

No HTTP server. The host joins the head for all its ranks at once (``dp_handshake.py``), starts
one ``run_engine_core`` process per rank on the socket addresses the head answers, and watches:

    every core exited 0 (the head sent SHUTDOWN to each)      -> exit 0
    a core exited otherwise                                  -> the head is told; the others
                                                                are stopped; exit 1
    the head silent for --engine-heartbeat-timeout, or it
    disowns these ranks (a restarted head)                   -> the cores are stopped; exit 1
    SIGTERM / SIGINT                                         -> the head is told; the cores are
                                                                stopped; exit 0
    the head unreachable or refusing the join                -> exit 1 (within the start-up
                                                                timeout, naming the address)

Killed outright, the host leaves no core behind (each dies with its parent, core_proc.py) and
the head sees their heartbeats stop.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import signal
import socket
import time
from types import FrameType

from axon.config import AxonConfig
from axon.engine.core_client import STARTUP_TIMEOUT_S, core_config, start_core_process, stop_process
from axon.engine.core_proc import HEARTBEAT_INTERVAL_S
from axon.engine.dp_handshake import HandshakeError, HeadLink

logger = logging.getLogger("axon.entrypoints.headless")

_STOP_JOIN_S = 5.0  # a terminated core exits at once; then it is killed

Processes = dict[int, multiprocessing.process.BaseProcess]  # global rank -> its core


def run_headless(args: argparse.Namespace, config: AxonConfig) -> int:
    p = config.parallel_config
    assert p.data_parallel_size_local, "cmd_serve checks that a headless host runs cores"
    ranks = list(range(p.data_parallel_start_rank, p.data_parallel_start_rank + p.data_parallel_size_local))
    link = HeadLink(p, socket.gethostname())
    try:
        logger.info(
            "headless: engine cores of ranks %d..%d (of %d) joining the head at %s",
            ranks[0],
            ranks[-1],
            p.data_parallel_size,
            link.endpoint,
        )
        addresses = link.join(ranks, STARTUP_TIMEOUT_S)
        processes: Processes = {}
        for rank in ranks:
            addr = addresses[rank]
            processes[rank] = start_core_process(
                core_config(config, rank), addr.input_addr, addr.output_addr, f"-{rank}"
            )
            logger.info(
                "engine core %d joined the head: pid %d, input %s, output %s",
                rank,
                processes[rank].pid,
                addr.input_addr,
                addr.output_addr,
            )
        return _supervise(link, processes, args.engine_heartbeat_timeout)
    except HandshakeError as e:
        logger.error("%s", e)
        return 1
    finally:
        link.close()


def _supervise(link: HeadLink, processes: Processes, head_timeout_s: float) -> int:
    """Watch the cores and the head (a ping every tick) until one of the ends above."""
    received: list[str] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(sig).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    ranks = list(processes)
    last_pong = time.monotonic()
    while True:
        failed = {rank: proc.exitcode for rank, proc in processes.items() if proc.exitcode not in (None, 0)}
        if failed:
            for rank, code in failed.items():
                logger.error("engine core %d exited with code %s; stopping this host's cores", rank, code)
                link.report_exit(rank, f"its process exited with code {code}")
            _stop(processes)
            return 1
        if all(proc.exitcode == 0 for proc in processes.values()):
            logger.info("the head stopped every engine core of this host; exiting")
            return 0
        if received:
            logger.info("received %s: stopping this host's engine cores", received[0])
            for rank in ranks:
                link.report_exit(rank, f"stopped by {received[0]} on its host")
            _stop(processes)
            return 0
        tick_end = time.monotonic() + HEARTBEAT_INTERVAL_S
        link.ping(ranks)
        try:
            if link.wait_pong(HEARTBEAT_INTERVAL_S):
                last_pong = time.monotonic()
        except HandshakeError as e:
            logger.error("%s; stopping this host's engine cores", e)
            _stop(processes)
            return 1
        silent_s = time.monotonic() - last_pong
        if silent_s > head_timeout_s:
            logger.error(
                "the head at %s has not answered for %.0f s (bound %.0f s, --engine-heartbeat-timeout): "
                "it is gone; stopping this host's engine cores",
                link.endpoint,
                silent_s,
                head_timeout_s,
            )
            _stop(processes)
            return 1
        time.sleep(max(0.0, tick_end - time.monotonic()))


def _stop(processes: Processes) -> None:
    """Terminate every live core, then reap each (killed if it lingers)."""
    for proc in processes.values():
        if proc.is_alive():
            proc.terminate()
    for proc in processes.values():
        stop_process(proc, _STOP_JOIN_S)
