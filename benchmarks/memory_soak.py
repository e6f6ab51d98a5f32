"""Soak an ``axon serve`` with streams that disconnect, and print the engine core's memory per round.

Each round sends ``--streams`` concurrent streaming chat requests (new prompts each round); each
reads ``--chunks`` chunks and then drops its connection, so the server aborts it. Once the engine
is idle, the engine-core process's RSS is printed, split into the KV cache's area and the rest.
The KV cache is an anonymous mapping that becomes resident block by block on first touch, up to
its full size: bounded and expected (README, "Memory of the engine process"). The kernel
merges it with the weights' huge-page arena into one area, so ``kv+weights`` is the weights
(fixed) plus the touched KV.
Buckets a round reaches are compiled when the engine is next idle: their memory shows in the
next rounds.

    python -m benchmarks.memory_soak --rounds 6        # starts axon serve with default flags
    python -m benchmarks.memory_soak --url http://127.0.0.1:8000 --pid ENGINE_PID --kv-gib 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import free_port, wait_healthy

_MIB = 1 << 20


@dataclass
class MemorySample:
    rss: int  # bytes, the whole process
    anon: int  # bytes of anonymous resident memory (smaps_rollup)
    kv_area_rss: int  # resident bytes of the area holding the KV cache (and the weights)

    @property
    def rest(self) -> int:
        return self.rss - self.kv_area_rss

    def line(self) -> str:
        return (
            f"rss {self.rss / _MIB:7.1f} MiB  anon {self.anon / _MIB:7.1f}  "
            f"kv+weights {self.kv_area_rss / _MIB:7.1f}  rest {self.rest / _MIB:7.1f}"
        )


def smaps_rollup_anon(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def mapping_rss(pid: int, min_size_bytes: int) -> int:
    """Resident bytes of the anonymous mappings of at least ``min_size_bytes``: the KV cache's
    (the kernel merges the per-layer K and V mappings, and the weights' huge-page arena next to
    them, into one area; the weights are resident from the start, so growth here is KV)."""
    total, in_match = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a header: start-end perms ...
                start, end = (int(x, 16) for x in fields[0].split("-"))
                in_match = end - start >= min_size_bytes and len(fields) == 5
            elif in_match and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def sample(pid: int, kv_bytes: int) -> MemorySample:
    return MemorySample(
        rss=psutil.Process(pid).memory_info().rss,
        anon=smaps_rollup_anon(pid),
        kv_area_rss=mapping_rss(pid, int(kv_bytes * 0.99)) if kv_bytes else 0,
    )


def engine_core_pid(server_pid: int) -> int:
    """The engine-core process: the server's multiprocessing spawn child (not its resource tracker)."""
    for child in psutil.Process(server_pid).children(recursive=True):
        if "spawn_main" in " ".join(child.cmdline()):
            return child.pid
    raise RuntimeError(f"no engine-core child under pid {server_pid}")


async def one_stream(client: httpx.AsyncClient, model: str, i: int, chunks: int, max_tokens: int) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Write a short story about robot number {i}."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream


def run_round(url: str, model: str, streams: int, chunks: int, max_tokens: int, first: int = 0) -> None:
    """``streams`` concurrent streams (prompts numbered from ``first``), each dropped after
    ``chunks`` chunks; returns once the engine is idle again."""

    async def gather() -> None:
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as client:
            await asyncio.gather(
                *(one_stream(client, model, first + i, chunks, max_tokens) for i in range(streams))
            )

    asyncio.run(gather())
    wait_idle(url)


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until /metrics shows no running or waiting request (the aborts have landed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10.0).text
        busy = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the engine did not become idle")


def kv_bytes_from_log(log: str) -> int:
    """The KV cache's size, from the engine's "KV cache: N blocks of B tokens (X GiB)" line."""
    for line in log.splitlines():
        if "KV cache:" in line and "GiB)" in line:
            return int(float(line.rsplit("(", 1)[1].split()[0]) * (1 << 30))
    return 0


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    """``axon serve`` with default flags (compiled buckets: AXON_ENFORCE_EAGER is dropped)."""
    port = free_port()
    log_path = tempfile.mktemp(prefix="axon-soak-", suffix=".log")
    env = {k: v for k, v in os.environ.items() if k != "AXON_ENFORCE_EAGER"}
    cmd = [sys.executable, "-m", "axon.entrypoints.cli", "serve", "--port", str(port), *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout=900.0)
    return proc, url, log_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else one is started with default flags)")
    p.add_argument("--pid", type=int, help="the engine core's pid, with --url")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--chunks", type=int, default=4, help="chunks each stream reads before disconnecting")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-gib", type=float, default=0.0, help="the KV cache's size, with --url")
    p.add_argument("serve_args", nargs="*", help="extra flags for the started server (after --)")
    args = p.parse_args()
    proc = None
    if args.url:
        url, pid, kv_bytes = args.url, args.pid, int(args.kv_gib * (1 << 30))
    else:
        proc, url, log_path = start_server(args.serve_args)
        pid = engine_core_pid(proc.pid)
        kv_bytes = kv_bytes_from_log(Path(log_path).read_text())
        print(f"server log: {log_path}; engine core pid {pid}; KV cache {kv_bytes / _MIB:.0f} MiB")
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    try:
        print(f"start     {sample(pid, kv_bytes).line()}")
        for r in range(args.rounds):
            t0 = time.perf_counter()
            run_round(url, model, args.streams, args.chunks, args.max_tokens, first=r * args.streams)
            print(f"round {r + 1:2d}  {sample(pid, kv_bytes).line()}  ({time.perf_counter() - t0:.1f} s)")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
