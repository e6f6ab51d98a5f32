"""Offline throughput on CUDA: axon eager, axon with compiled buckets, and transformers' ``generate``.

A ~1B-parameter Llama shape (Llama-3.2-1B's layers over SmolLM2's 49,152-token vocabulary, so
every sampled id detokenizes) with random weights (axon's ``load_format="dummy"``; transformers
initialises its own on the device), bfloat16. Fixed workloads of random token-id prompts, greedy,
EOS ignored, every request the same length; per engine: load, one warm-up run, ``--runs`` timed
runs, the median reported. Rows are printed as they finish, so a run cut short still reports.

    python3 benchmarks/gpu/bench_cuda.py                          # on a CUDA machine
    python3 benchmarks/gpu/bench_cuda.py --device cpu --tiny      # a quick try of the code path
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import ThroughputResult, markdown_table, random_prompts, smollm2_folder
from benchmarks.offline_throughput import AxonEngine, Engine, TransformersEngine, check_lengths, time_runs

GPU_TOKENIZER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    ".gpu_assets",
    "smollm2-tokenizer",
)
# Llama-3.2-1B's layer shapes (16 layers, 2048 wide, GQA 32/8); ~1.07B parameters with this vocab.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
TINY = {
    **LLAMA_1B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
WORKLOADS = "16x128x128,64x512x128"  # prompts x input tokens x output tokens
TINY_WORKLOADS = "4x32x8,8x64x8"
MAX_NUM_BATCHED_TOKENS = 2048
PROMPT_SEED = 0
BLOCK_SIZE = 16  # axon's default
AXON_MAX_MODEL_LEN = 2048  # what AxonEngine asks for


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int

    @property
    def name(self) -> str:
        return f"{self.num_prompts} x {self.input_len} -> {self.output_len}"


def parse_workloads(text: str) -> list[Workload]:
    out = []
    for item in text.split(","):
        try:
            n, i, o = (int(v) for v in item.strip().split("x"))
        except ValueError:
            raise ValueError(f"workload {item!r} is not PROMPTSxINPUTxOUTPUT, e.g. 16x128x128") from None
        if min(n, i, o) < 1:
            raise ValueError(f"workload {item!r}: every number must be at least 1")
        out.append(Workload(n, i, o))
    return out


def tokenizer_folder() -> str:
    """SmolLM2's tokenizer: the copy that travels to a GPU host, else the bundled model's."""
    if os.path.isfile(os.path.join(GPU_TOKENIZER, "tokenizer.json")):
        return GPU_TOKENIZER
    return smollm2_folder()


def write_model_folder(shape: dict[str, Any], folder: str) -> str:
    """A config.json and tokenizer, no weights: axon loads it with load_format="dummy"."""
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder())
    config = LlamaConfig(
        **shape,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def axon_options(args: argparse.Namespace, workloads: list[Workload], compiled: bool) -> dict[str, Any]:
    """Buckets only where these workloads go: one decode graph per batch size, one prefill graph."""
    max_seqs = max(w.num_prompts for w in workloads)
    opts: dict[str, Any] = {
        "device": args.device,
        "load_format": "dummy",
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enforce_eager": not compiled,
    }
    if compiled:
        opts |= {
            "bucket_compile": "warmup",
            "num_seqs_buckets": sorted({w.num_prompts for w in workloads}),
            "num_batched_tokens_buckets": [args.max_num_batched_tokens],
            "cache_root": args.cache_root,
        }
    # The eager engine sizes its KV cache from gpu_memory_utilization (the CUDA path users take);
    # the compiled one gets what the workloads need, whatever the first engine left behind.
    if args.device == "cuda" and not compiled:
        opts["gpu_memory_utilization"] = 0.3
    else:
        # Every sequence whole at once, and at least one of AxonEngine's max_model_len (+ block 0).
        blocks_per_seq = -(-max(w.input_len + w.output_len for w in workloads) // BLOCK_SIZE)
        opts["num_gpu_blocks_override"] = max(max_seqs * blocks_per_seq, AXON_MAX_MODEL_LEN // BLOCK_SIZE) + 1
    return opts


def bench_engine(
    label: str, make: Any, workloads: list[Workload], args: argparse.Namespace
) -> list[ThroughputResult]:
    sync()
    start = time.perf_counter()
    engine: Engine = make()
    load_s = time.perf_counter() - start
    print(f"[{label}] loaded in {load_s:.1f} s", flush=True)
    describe(label, engine)
    results = []
    for w in workloads:
        prompts = random_prompts(w.num_prompts, w.input_len, args.vocab_size, PROMPT_SEED)
        check_lengths(label, w.name, engine.generate(prompts, w.output_len), w.output_len)  # warm-up
        if hasattr(engine, "settle"):
            engine.settle()
        runs = time_runs(engine, prompts, w.output_len, args.runs)
        r = ThroughputResult(w.name, label, w.num_prompts, w.input_len, w.output_len, load_s, runs)
        print(f"[{label}] {w.name}: {r.output_tok_s:,.0f} output tok/s, runs {fmt_runs(runs)} s", flush=True)
        results.append(r)
    del engine
    gc.collect()
    free_device()
    return results


def describe(label: str, engine: Engine) -> None:
    """What an axon engine resolved to on this device: backends, KV blocks, compiled buckets."""
    llm = getattr(engine, "llm", None)
    if llm is None:
        return
    core = llm.llm_engine.engine_core
    worker = core.executor.worker
    line = (
        f"[{label}] attention={worker.attention_backend} linear={worker.linear_backend} "
        f"dtype={worker.dtype} kv_blocks={core.num_blocks} async_scheduling={core.async_scheduling}"
    )
    if worker.compiler is not None:
        stats = worker.compiler.stats
        compiled = ", ".join(f"{n}: {r.seconds:.1f} s" for n, r in sorted(stats.records.items()))
        line += f" compiled buckets (tokens: seconds) {compiled or 'none'}"
        if stats.failures:
            line += f" FAILED {stats.failures}"
    print(line, flush=True)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"  cuda memory allocated after release: {torch.cuda.memory_allocated() / 2**30:.2f} GiB")


class SyncedTransformers(TransformersEngine):
    """transformers' generate, timed to the end of its device work."""

    def generate(self, prompts: list[list[int]], output_len: int) -> list[int]:
        out = super().generate(prompts, output_len)
        sync()
        return out


def fmt_runs(runs: Sequence[float]) -> str:
    return "/".join(f"{t:.2f}" for t in runs)


def results_table(results: list[ThroughputResult]) -> str:
    base = {r.model: r for r in results if r.engine.startswith("transformers")}
    rows = []
    for r in results:
        b = base.get(r.model)
        ratio = f"{r.output_tok_s / b.output_tok_s:.2f}x" if b is not None and r is not b else ""
        rows.append(
            [
                r.model,
                r.engine,
                f"{r.output_tok_s:,.0f}",
                f"{r.total_tok_s:,.0f}",
                ratio,
                f"{r.median_s:.2f}",
                fmt_runs(r.run_s),
                f"{r.load_s:.1f}",
            ]
        )
    header = [
        "workload",
        "engine",
        "output tok/s",
        "total tok/s",
        "vs transformers",
        "median s",
        "runs s",
        "load s",
    ]
    return markdown_table(header, rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small workloads (a dry run)")
    p.add_argument("--workloads", default=None, help=f"PROMPTSxINPUTxOUTPUT list (default {WORKLOADS})")
    p.add_argument(
        "--engines", default="eager,transformers,compiled", help="comma list of eager, compiled, transformers"
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--hf-cache", default=None, help="transformers' cache_implementation (e.g. static)")
    p.add_argument("--cache-root", default=None, help="axon's compile cache (default: a fresh temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.workloads = parse_workloads(args.workloads or (TINY_WORKLOADS if args.tiny else WORKLOADS))
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - {"eager", "compiled", "transformers"}
    if unknown or not args.engines:
        p.error(
            f"--engines: unknown {sorted(unknown) or args.engines}; supported: eager, compiled, transformers"
        )
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 256 if args.tiny else MAX_NUM_BATCHED_TOKENS
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    return args


def environment(device: str) -> str:
    import torch
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return f"device: {name}; torch {torch.__version__}; transformers {transformers.__version__}"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # A time limit's SIGTERM unwinds through main's finally: the rows measured so far are printed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    env = environment(args.device)
    print(env, flush=True)
    work = tempfile.mkdtemp(prefix="axon-bench-cuda-")
    args.cache_root = args.cache_root or os.path.join(work, "cache")
    folder = write_model_folder(TINY if args.tiny else LLAMA_1B, os.path.join(work, "model"))
    with open(os.path.join(folder, "config.json")) as f:
        args.vocab_size = json.load(f)["vocab_size"]
    seqs = max(w.num_prompts for w in args.workloads)
    makers = {
        "eager": lambda: AxonEngine(
            folder, args.dtype, seqs, axon_options(args, args.workloads, compiled=False)
        ),
        "compiled": lambda: AxonEngine(
            folder, args.dtype, seqs, axon_options(args, args.workloads, compiled=True)
        ),
        "transformers": lambda: SyncedTransformers(
            folder,
            args.dtype,
            seqs,
            device=args.device,
            random_weights=True,
            cache_implementation=args.hf_cache,
        ),
    }
    labels = {"eager": "axon eager", "compiled": "axon compiled", "transformers": "transformers"}
    if args.hf_cache:
        labels["transformers"] = f"transformers ({args.hf_cache} cache)"
    results: list[ThroughputResult] = []
    try:
        for name in args.engines:
            results += bench_engine(labels[name], makers[name], args.workloads, args)
    finally:
        engine_order = {labels[n]: i for i, n in enumerate(["transformers", "eager", "compiled"])}
        workload_order = {w.name: i for i, w in enumerate(args.workloads)}
        results.sort(key=lambda r: (workload_order[r.model], engine_order[r.engine]))
        print(f"\n{env}; {args.dtype}; {'tiny' if args.tiny else '~1B'} Llama, random weights\n", flush=True)
        print(results_table(results), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "results": [r.to_json() for r in results]}, f, indent=1)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
