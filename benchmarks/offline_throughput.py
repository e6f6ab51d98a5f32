"""Offline batch throughput: axon's ``LLM.generate`` against transformers' ``generate``.

A fixed workload (random token-id prompts, greedy, EOS ignored, every request the same length)
run on each model by each engine in one process: load, one warm-up run, then ``--runs`` timed runs.
Reports the median output and total (prompt + output) tokens/s and the ratio axon/transformers.

    python -m benchmarks.offline_throughput                  # the default workload
    python -m benchmarks.offline_throughput --models tiny --num-prompts 4 --output-len 16 --runs 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    MODEL_FOLDERS,
    ThroughputResult,
    markdown_table,
    model_folder,
    random_prompts,
    time_call,
    vocab_size,
)

PROMPT_SEED = 0


class Engine(Protocol):
    """One loaded model. ``generate`` returns the number of new tokens made for each prompt."""

    def generate(self, prompts: list[list[int]], output_len: int) -> list[int]: ...


class AxonEngine:
    def __init__(
        self, folder: str, dtype: str, max_num_seqs: int | None, extra: dict[str, Any] | None = None
    ) -> None:
        from axon import LLM

        seqs = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
        self.llm = LLM(
            model=folder,
            dtype=dtype,
            max_model_len=2048,
            enable_prefix_caching=False,
            **{**seqs, **(extra or {})},
        )

    def generate(self, prompts: list[list[int]], output_len: int) -> list[int]:
        from axon import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    def settle(self) -> None:
        """After a warm-up: compile the buckets it reached, so timed runs measure the graphs
        (vLLM compiles before serving, so this is like for like)."""
        self.llm.llm_engine.engine_core.compile_pending()


class TransformersEngine:
    """transformers' ``generate`` on ``device``; ``random_weights`` builds the model from the
    folder's config.json alone (initialised on the device), for configs with no checkpoint."""

    def __init__(
        self,
        folder: str,
        dtype: str,
        max_num_seqs: int,
        device: str = "cpu",
        random_weights: bool = False,
        cache_implementation: str | None = None,
    ) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = torch.device(device)
        self.cache_implementation = cache_implementation
        if random_weights:
            with self.device:
                model = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype)
                )
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(self.device)
        self.model = model.eval()

    def generate(self, prompts: list[list[int]], output_len: int) -> list[int]:
        import torch
        from transformers import GenerationConfig

        # All prompts have the same length, so the batch needs no padding.
        input_ids = torch.tensor(prompts, device=self.device)  # [num_prompts, input_len]
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            eos_token_id=None,
            pad_token_id=0,
            cache_implementation=self.cache_implementation,
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        # [num_prompts, input_len + num_new_tokens]
        return [out.shape[1] - input_ids.shape[1]] * out.shape[0]


ENGINES: dict[str, Callable[[str, str, int], Engine]] = {
    "axon": AxonEngine,
    "transformers": TransformersEngine,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,smollm2", help=f"comma list of {', '.join(MODEL_FOLDERS)}")
    p.add_argument("--engines", default="axon,transformers", help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's, all cores)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.models = _names(p, "--models", args.models, MODEL_FOLDERS)
    args.engines = _names(p, "--engines", args.engines, ENGINES)
    for flag in ("num_prompts", "input_len", "output_len", "runs", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def _names(p: argparse.ArgumentParser, flag: str, value: str, known: Mapping[str, object]) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"{flag}: unknown {unknown or value!r}; supported: {', '.join(known)}")
    return names


def bench_one(
    model: str, engine_name: str, prompts: list[list[int]], args: argparse.Namespace
) -> ThroughputResult:
    folder = model_folder(model)
    start = time.perf_counter()
    engine = ENGINES[engine_name](folder, args.dtype, args.num_prompts)
    load_s = time.perf_counter() - start
    check_lengths(engine_name, model, engine.generate(prompts, args.output_len), args.output_len)  # warm-up
    run_s = time_runs(engine, prompts, args.output_len, args.runs)
    del engine
    gc.collect()
    return ThroughputResult(
        model, engine_name, args.num_prompts, args.input_len, args.output_len, load_s, run_s
    )


def time_runs(engine: Engine, prompts: list[list[int]], output_len: int, runs: int) -> list[float]:
    return [time_call(lambda: engine.generate(prompts, output_len)) for _ in range(runs)]


def check_lengths(engine: str, model: str, lengths: list[int], output_len: int) -> None:
    wrong = [n for n in lengths if n != output_len]
    status = "ok" if not wrong else f"MISMATCH: {len(wrong)} prompts got {sorted(set(wrong))}"
    print(
        f"[{model}/{engine}] {len(lengths)} prompts x {output_len} new tokens expected: {status}", flush=True
    )


TABLE_HEADER = [
    "model",
    "engine",
    "output tok/s",
    "total tok/s",
    "axon/transformers",
    "median s",
    "runs s",
    "load s",
]


def results_table(results: list[ThroughputResult]) -> str:
    by_key = {(r.model, r.engine): r for r in results}
    return markdown_table(TABLE_HEADER, [_row(r, by_key.get((r.model, "transformers"))) for r in results])


def _row(r: ThroughputResult, base: ThroughputResult | None) -> list[str]:
    ratio = f"{r.output_tok_s / base.output_tok_s:.2f}x" if base is not None and r.engine == "axon" else ""
    runs = "/".join(f"{t:.1f}" for t in r.run_s)
    return [
        r.model,
        r.engine,
        f"{r.output_tok_s:,.1f}",
        f"{r.total_tok_s:,.1f}",
        ratio,
        f"{r.median_s:.2f}",
        runs,
        f"{r.load_s:.1f}",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # both engines run in this process and use torch's setting
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.num_prompts} prompts x "
        f"{args.input_len} -> {args.output_len} tokens, greedy, {args.dtype}, {args.runs} runs",
        flush=True,
    )
    results = []
    for model in args.models:
        prompts = random_prompts(
            args.num_prompts, args.input_len, vocab_size(model_folder(model)), PROMPT_SEED
        )
        results += [bench_one(model, engine, prompts, args) for engine in args.engines]
    print(results_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [r.to_json() for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
