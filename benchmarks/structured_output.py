"""Structured-output overhead: the same offline workload with and without a JSON-schema constraint.

16 concurrent requests (one ``LLM.generate``), greedy, every request exactly ``--output-len``
tokens: the schema asks for a JSON array longer than that, so constrained requests are cut by
length just as the unconstrained ones (EOS ignored) are. Reports output tokens/s of both, the
wall-clock overhead per output token in microseconds and as a share of the step time, and the
time spent in the grammar itself (bitmask fill + token accept in the scheduler, mask in the
sampler), measured by timing those calls.

    python -m benchmarks.structured_output
    python -m benchmarks.structured_output --num-prompts 4 --output-len 16 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_table, model_folder, time_call

# More items than any run's output holds, so every constrained request runs to max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
    },
    "minItems": 500,
}


class Timers:
    """Wraps callables and adds up the seconds spent in them."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def build(args: argparse.Namespace):
    from axon import LLM

    return LLM(
        model=model_folder(args.model),
        dtype=args.dtype,
        max_model_len=1024,
        max_num_seqs=args.num_prompts,
        enable_prefix_caching=False,
    )


def instrument(llm: Any) -> Timers:
    """Time the grammar's calls: scheduler-side fill and accept, sampler-side mask."""
    import axon.sample.sampler as sampler_module

    timers = Timers()
    manager = llm.llm_engine.engine_core.scheduler.structured_output_manager
    manager.grammar_output = timers.wrap(manager.grammar_output)
    manager.accept = timers.wrap(manager.accept)
    sampler_module.apply_grammar_bitmask = timers.wrap(sampler_module.apply_grammar_bitmask)
    return timers


def workload(llm: Any, args: argparse.Namespace, constrained: bool) -> Callable[[], int]:
    from axon import SamplingParams, StructuredOutputsParams

    tokenizer = llm.get_tokenizer()
    prompts = [
        {"prompt_token_ids": tokenizer.encode(f"Record {i}: a JSON list of items with ids and flags:")}
        for i in range(args.num_prompts)
    ]
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, structured_outputs=so)

    def run() -> int:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert all(n == args.output_len for n in lengths), f"lengths {sorted(set(lengths))}"
        if constrained:
            prefix = outputs[0].outputs[0].text
            assert prefix.lstrip().startswith("["), f"not a JSON array: {prefix[:40]!r}"
        return sum(lengths)

    return run


def bench(args: argparse.Namespace) -> dict[str, Any]:
    llm = build(args)
    timers = instrument(llm)
    results: dict[str, Any] = {}
    for name, constrained in (("unconstrained", False), ("json_schema", True)):
        run = workload(llm, args, constrained)
        num_tokens = run()  # warm-up (and the grammar's compile, which is then cached)
        timers.seconds = 0.0
        runs = [time_call(run) for _ in range(args.runs)]
        results[name] = {
            "runs_s": runs,
            "median_s": statistics.median(runs),
            "output_tok_s": num_tokens / statistics.median(runs),
            "grammar_s_per_run": timers.seconds / args.runs,
            "num_tokens": num_tokens,
        }
    plain, so = results["unconstrained"], results["json_schema"]
    num_tokens, num_steps = plain["num_tokens"], args.output_len  # one decode step per output position
    results["overhead_us_per_token"] = (so["median_s"] - plain["median_s"]) / num_tokens * 1e6
    results["overhead_pct_of_step"] = (so["median_s"] - plain["median_s"]) / plain["median_s"] * 100
    results["grammar_us_per_token"] = so["grammar_s_per_run"] / num_tokens * 1e6
    results["grammar_pct_of_step"] = so["grammar_s_per_run"] / so["median_s"] * 100
    results["step_ms"] = plain["median_s"] / num_steps * 1e3
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [
        [name, f"{r['output_tok_s']:,.1f}", f"{r['median_s']:.2f}", "/".join(f"{t:.2f}" for t in r["runs_s"])]
        for name, r in ((n, results[n]) for n in ("unconstrained", "json_schema"))
    ]
    table = markdown_table(["workload", "output tok/s", "median s", "runs s"], rows)
    lines = [
        table,
        f"step time (unconstrained): {results['step_ms']:.1f} ms for {args.num_prompts} sequences",
        (
            f"wall-clock overhead: {results['overhead_us_per_token']:.1f} us per output token "
            f"({results['overhead_pct_of_step']:.1f}% of step time)"
        ),
        (
            f"time in grammar calls: {results['grammar_us_per_token']:.1f} us per output token "
            f"({results['grammar_pct_of_step']:.1f}% of step time)"
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (the grammar needs its real tokenizer)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    for flag in ("num_prompts", "output_len", "runs", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model}, {args.num_prompts} "
        f"concurrent requests x {args.output_len} tokens, greedy, {args.dtype}, {args.runs} runs",
        flush=True,
    )
    results = bench(args)
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
