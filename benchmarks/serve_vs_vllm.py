"""Online serving: ``axon bench serve`` against ``axon serve`` and against vLLM's OpenAI server.

For each engine: start its server process on a free port, time process start -> ``/health`` 200,
run one short warm-up load, then ``--runs`` timed loads of the same workload (random prompts,
streaming ``/v1/completions``, EOS ignored), stop the server with SIGTERM. Prints one table with
each engine's median over the runs and the ratios axon/vLLM.

    python -m benchmarks.serve_vs_vllm                                   # both engines
    python -m benchmarks.serve_vs_vllm --engines axon --num-prompts 8 --runs 1

vLLM runs from its own virtual environment (``--vllm-python``), with the environment its CPU
docs recommend (KV space, thread binding, tcmalloc + its bundled libiomp5 preloaded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from axon.entrypoints.bench_serve import add_serve_args, run_benchmark
from benchmarks.common import markdown_table, model_folder

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, folder: str, port: int, args: argparse.Namespace) -> list[str]:
    common = ["--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port)]
    if engine == "axon":
        return [sys.executable, "-m", "axon.entrypoints.cli", "serve", folder, *common]
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, *common]


def server_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib))
    if engine == "vllm":
        venv = os.path.dirname(os.path.dirname(args.vllm_python))
        preload = [p for p in (TCMALLOC, os.path.join(venv, "lib", "libiomp5.so")) if os.path.exists(p)]
        env.update(VLLM_CPU_OMP_THREADS_BIND=args.threads_bind, LD_PRELOAD=":".join(preload))
    return env


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before /health answered 200")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"/health did not answer 200 within {timeout:.0f} s")


def load_args(port: int, num_prompts: int, output_len: int, args: argparse.Namespace) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(
        [
            "--port", str(port),
            "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts),
            "--max-concurrency", str(args.max_concurrency),
            "--ignore-eos",
            "--disable-tqdm",
            "--tokenizer", args.folder,
        ]
    )  # fmt: skip


@dataclass
class EngineResult:
    engine: str
    startup_s: float
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs)


def bench_engine(engine: str, args: argparse.Namespace) -> EngineResult:
    port = free_port()
    log_path = os.path.join(args.log_dir, f"serve-{engine}.log")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            server_command(engine, args.folder, port, args),
            env=server_env(engine, args),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, args.startup_timeout)
            result = EngineResult(engine, time.perf_counter() - start)
            print(f"{engine}: /health 200 after {result.startup_s:.1f} s (log: {log_path})", flush=True)
            asyncio.run(run_benchmark(load_args(port, args.max_concurrency, 16, args)))  # warm-up
            for i in range(args.runs):
                print(f"{engine}: run {i + 1}/{args.runs}", flush=True)
                run = asyncio.run(run_benchmark(load_args(port, args.num_prompts, args.output_len, args)))
                if run["failed"]:
                    raise RuntimeError(f"{engine}: {run['failed']} requests failed; see {log_path}")
                result.runs.append(run)
            return result
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


COLUMNS = [
    ("output tok/s", "output_throughput", "{:,.1f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("median TTFT ms", "median_ttft_ms", "{:,.0f}"),
    ("p99 TTFT ms", "p99_ttft_ms", "{:,.0f}"),
    ("median TPOT ms", "median_tpot_ms", "{:.1f}"),
    ("median ITL ms", "median_itl_ms", "{:.1f}"),
    ("median E2EL ms", "median_e2el_ms", "{:,.0f}"),
]


def report(results: list[EngineResult]) -> str:
    header = ["engine", "start -> /health s", *(c[0] for c in COLUMNS), "runs (output tok/s)"]
    rows = []
    for r in results:
        runs = "/".join(f"{run['output_throughput']:.0f}" for run in r.runs)
        cells = [fmt.format(r.median(key)) for _, key, fmt in COLUMNS]
        rows.append([r.engine, f"{r.startup_s:.1f}", *cells, runs])
    by_name = {r.engine: r for r in results}
    if "axon" in by_name and "vllm" in by_name:
        a, v = by_name["axon"], by_name["vllm"]
        ratios = [f"{a.median(key) / v.median(key):.2f}x" for _, key, _ in COLUMNS]
        rows.append(["axon/vllm", f"{a.startup_s / v.startup_s:.2f}x", *ratios, ""])
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="axon,vllm")
    p.add_argument("--model", default="smollm2", help="a benchmarks.common model name")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kv-space-gib", type=float, default=4)
    p.add_argument("--threads-bind", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default=None, help="write every run's full result here")
    args = p.parse_args(argv)
    args.folder = model_folder(args.model)
    results = [bench_engine(e, args) for e in args.engines.split(",")]
    print(
        f"\n{args.model}, {args.dtype}, {args.num_prompts} requests, {args.input_len} in / "
        f"{args.output_len} out (random, EOS ignored), max concurrency {args.max_concurrency}, "
        f"median of {args.runs} runs\n"
    )
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
