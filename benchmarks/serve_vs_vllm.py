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
import functools
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from axon.entrypoints.bench_serve import add_serve_args, run_benchmark, validate_args
from benchmarks.common import markdown_table, model_folder, running_server, serve_command, vllm_cpu_env


def server_command(engine: str, port: int, args: argparse.Namespace) -> list[str]:
    return serve_command(engine, args.folder, port, ["--dtype", args.dtype], args.vllm_python)


def server_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    if engine == "vllm":
        return vllm_cpu_env(args.vllm_python, args.kv_space_gib, args.threads_bind)
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{args.kv_space_gib:g}")


def load_args(port: int, num_prompts: int, output_len: int, args: argparse.Namespace) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    load = parser.parse_args(
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
    validate_args(load)  # as `axon bench serve` does: resolves --backend's endpoint
    return load


@dataclass
class EngineResult:
    engine: str
    startup_s: float
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs)


def bench_engine(engine: str, args: argparse.Namespace) -> EngineResult:
    log_path = os.path.join(args.log_dir, f"serve-{engine}.log")
    command = functools.partial(server_command, engine, args=args)
    with running_server(command, server_env(engine, args), log_path, args.startup_timeout) as server:
        port = server.port
        result = EngineResult(engine, server.startup_s)
        print(f"{engine}: /health 200 after {result.startup_s:.1f} s (log: {log_path})", flush=True)
        asyncio.run(run_benchmark(load_args(port, args.max_concurrency, 16, args)))  # warm-up
        for i in range(args.runs):
            print(f"{engine}: run {i + 1}/{args.runs}", flush=True)
            run = asyncio.run(run_benchmark(load_args(port, args.num_prompts, args.output_len, args)))
            if run["failed"]:
                raise RuntimeError(f"{engine}: {run['failed']} requests failed; see {log_path}")
            result.runs.append(run)
        return result


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
