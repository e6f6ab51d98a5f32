"""Data parallelism: ``axon serve --data-parallel-size 1`` against ``2`` under ``axon bench serve``.

The bundled SmolLM2-135M-Instruct is served with the same flags but ``--data-parallel-size``
(``--max-model-len 512 --max-num-seqs 32``; the default ``auto`` thread binding gives one core
all CPUs, or each of N cores an equal share). Each server is started alone, warmed up with one
short run at the same concurrency, then measured ``--runs`` times with ``axon bench serve``:
``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` tokens each (EOS
ignored, greedy), ``--concurrency`` clients in flight. Reported: the median output tokens/s per
size, every run's, and the ratio DP=N / DP=1. The load generator runs on the same CPUs as the
server, alike for both sizes.

Graphs run eagerly (``--enforce-eager``) in both by default, so that no run waits for an
on-demand compilation and the comparison is of the engine cores alone; ``--server-args`` adds
flags to both servers (e.g. ``--server-args='--bucket-compile warmup'`` without eager mode).

    python -m benchmarks.data_parallel                               # DP 1 vs 2, 3 runs, ~6 minutes
    python -m benchmarks.data_parallel --runs 1 --num-prompts 32 --output-len 32   # a quick try
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cpu_summary, markdown_table, running_server, serve_command, smollm2_folder

SERVER_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--disable-log-stats"]


@dataclass
class SizeResult:
    data_parallel_size: int
    startup_s: float
    output_tok_s: list[float] = field(default_factory=list)  # one a timed run

    @property
    def median(self) -> float:
        return statistics.median(self.output_tok_s)


def bench_serve(port: int, num_prompts: int, output_len: int, args: argparse.Namespace) -> float:
    """One ``axon bench serve`` run against 127.0.0.1:port; its output tokens/s."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "axon.entrypoints.cli", "bench", "serve", "--port", str(port)]
        cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(output_len)]
        cmd += ["--num-prompts", str(num_prompts), "--max-concurrency", str(args.concurrency)]
        cmd += ["--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", out]
        cmd += ["--result-filename", "result.json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout)
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed")
    return float(result["output_throughput"])


def bench_size(size: int, args: argparse.Namespace) -> SizeResult:
    extra = [*SERVER_FLAGS, "--data-parallel-size", str(size), *shlex.split(args.server_args)]
    if args.eager:
        extra.append("--enforce-eager")
    command = functools.partial(serve_command, "axon", args.folder, extra=extra, vllm_python="")
    log_path = os.path.join(args.log_dir, f"data-parallel-{size}.log")
    with running_server(command, dict(os.environ), log_path, args.startup_timeout) as server:
        print(f"DP={size}: /health 200 after {server.startup_s:.1f} s (log: {log_path})", flush=True)
        result = SizeResult(size, server.startup_s)
        bench_serve(server.port, args.concurrency, min(args.output_len, 16), args)  # warm-up
        for i in range(args.runs):
            result.output_tok_s.append(bench_serve(server.port, args.num_prompts, args.output_len, args))
            print(
                f"DP={size}: run {i + 1}/{args.runs}: {result.output_tok_s[-1]:.1f} output tok/s", flush=True
            )
    return result


def report(results: list[SizeResult]) -> list[str]:
    base = results[0].median
    header = ["--data-parallel-size", "output tok/s (median)", "runs", "vs DP=1", "start -> /health s"]
    rows = [
        [
            str(r.data_parallel_size),
            f"{r.median:,.1f}",
            " ".join(f"{x:.1f}" for x in r.output_tok_s),
            f"{r.median / base:.2f}x",
            f"{r.startup_s:.1f}",
        ]
        for r in results
    ]
    return [markdown_table(header, rows)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,2", help="data-parallel sizes, the first the baseline")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--server-args", default="", help="more flags for both servers, one string")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--run-timeout", type=float, default=1200)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default=None, help="write the arguments and every run's tok/s")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    for name in ("concurrency", "num_prompts", "input_len", "output_len", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.folder = smollm2_folder()
    results = [bench_size(size, args) for size in args.sizes]
    mode = "eager" if args.eager else "compiled"
    print(
        f"\nSmolLM2-135M-Instruct (bundled), {' '.join(SERVER_FLAGS[:4])}, {mode}; axon bench serve: "
        f"{args.num_prompts} random prompts x {args.input_len} -> {args.output_len} tokens (EOS "
        f"ignored), {args.concurrency} concurrent; median of {args.runs} runs after a warm-up; "
        f"{cpu_summary()}\n"
    )
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "cpu": cpu_summary(), "results": [asdict(r) for r in results]},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
