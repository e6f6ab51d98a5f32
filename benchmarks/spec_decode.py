"""Speculative decoding, side by side: axon with and without it, vLLM's CPU build with the same method.

Workloads (greedy; single stream: one request at a time, output tokens/s over all of them):

- ``edit``: code editing, copy-heavy. The prompt holds a ~400-token Python file and asks for it
  back with one function renamed; ngram lookup finds most of the answer in the prompt.
- ``chat``: held-out chat prompts (not the ones ``axon train-eagle3`` trains on), for an EAGLE3
  head (``--eagle3-head``) or a draft model (``--draft-model``).
- ``batch``: workload (b) of ``benchmarks.vs_peers``, 16 prompts of 128 random ids -> 128 tokens
  at once: speculation on must cost at most 3% there (axon's adaptive policy turns it off).

Each (workload, engine, method) runs in its own subprocess: load, one warm-up (for axon, then
the buckets it reached compiled, as vLLM compiles its graphs at start-up), ``--runs`` timed
runs, the median reported; the table gives tokens/s, the mean acceptance length (1 + accepted
drafts per verification, from the engine's own counters) and the speedups.

    python -m benchmarks.spec_decode                                    # edit and batch, axon + vLLM
    python -m benchmarks.spec_decode --workloads chat --eagle3-head DIR --engines axon,vllm
    python -m benchmarks.spec_decode --workloads edit --engines axon --runs 1  # a quick try
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    cpu_summary,
    markdown_table,
    model_folder,
    random_prompts,
    run_json_worker,
    vllm_cpu_env,
    vocab_size,
)

THIS_FILE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(THIS_FILE))

EDIT_SOURCE = '''\
import json
import os
from dataclasses import dataclass, field


@dataclass
class Inventory:
    """Items in a warehouse, by name, with their counts and prices."""

    counts: dict[str, int] = field(default_factory=dict)
    prices: dict[str, float] = field(default_factory=dict)

    def add_item(self, name: str, count: int, price: float) -> None:
        if count < 0:
            raise ValueError(f"count of {name} must not be negative, got {count}")
        self.counts[name] = self.counts.get(name, 0) + count
        self.prices[name] = price

    def remove_item(self, name: str, count: int) -> None:
        have = self.counts.get(name, 0)
        if count > have:
            raise ValueError(f"only {have} of {name} in stock, asked for {count}")
        self.counts[name] = have - count

    def total_value(self) -> float:
        return sum(self.counts[name] * self.prices[name] for name in self.counts)

    def low_stock(self, threshold: int = 5) -> list[str]:
        return sorted(name for name, count in self.counts.items() if count < threshold)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"counts": self.counts, "prices": self.prices}, f, indent=2)

    @classmethod
    def load(cls, path: str) -> "Inventory":
        if not os.path.exists(path):
            return cls()
        with open(path) as f:
            data = json.load(f)
        return cls(counts=data["counts"], prices=data["prices"])
'''
EDIT_REQUESTS = [
    "Rename the method total_value to inventory_value. Reply with the whole file and nothing else.",
    "Rename the method low_stock to items_below. Reply with the whole file and nothing else.",
    "Change the default threshold of low_stock from 5 to 10. Reply with the whole file and nothing else.",
]
CHAT_PROMPTS = [  # held out: not in axon/spec_decode/prompts.py
    "Explain how a bicycle's gears make climbing hills easier.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for writing maintainable Python code?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple vegetable soup.",
    "Why do cats purr? Give a few possible reasons.",
]
WORKLOADS = ("edit", "chat", "batch")


# ---- the worker: one engine, one method, in its own process ----


def _messages(workload: str) -> list[list[dict[str, str]]]:
    if workload == "edit":
        return [
            [{"role": "user", "content": f"```python\n{EDIT_SOURCE}```\n\n{req}"}] for req in EDIT_REQUESTS
        ]
    return [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]


def _spec_counts(llm: Any, engine: str) -> tuple[int, int, int]:
    """(verifications, drafted tokens, accepted tokens) so far."""
    if engine == "axon":
        totals = llm.llm_engine.engine_core.scheduler.spec_totals
        return totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens
    counts = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
              "vllm:spec_decode_num_accepted_tokens": 0}  # fmt: skip
    for metric in llm.get_metrics():
        if metric.name in counts:
            counts[metric.name] += int(metric.value)
    return tuple(counts.values())  # type: ignore[return-value]


def worker_main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    engine, workload = spec["engine"], spec["workload"]
    if engine == "axon":
        from axon import LLM, SamplingParams
    else:
        from vllm import LLM, SamplingParams  # type: ignore[no-redef]
    kwargs: dict[str, Any] = {"dtype": spec["dtype"], "max_model_len": 2048}
    if spec["speculative_config"]:
        kwargs["speculative_config"] = spec["speculative_config"]
    kwargs["enable_prefix_caching"] = False
    if engine == "vllm":
        kwargs["disable_log_stats"] = False  # its spec-decode counters come from the stats
    start = time.perf_counter()
    llm = LLM(model=spec["folder"], **kwargs)
    load_s = time.perf_counter() - start

    if workload == "batch":
        prompts = [{"prompt_token_ids": p} for p in random_prompts(16, 128, vocab_size(spec["folder"]))]
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)

        def run_once() -> int:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
    else:
        conversations = _messages(workload)
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])

        def run_once() -> int:  # one request at a time: single-stream latency
            return sum(
                len(llm.chat([conv], params, use_tqdm=False)[0].outputs[0].token_ids)
                for conv in conversations
            )

    run_once()  # warm-up (caches; axon's steps run eagerly until their buckets compile)
    if engine == "axon":
        # Compile the buckets the warm-up reached now, not at the start of the first timed run
        # (offline, axon compiles them when the next call begins); again if a second warm-up
        # reached more (the adaptive policy's draft counts vary with its acceptance estimate).
        for _ in range(3):
            if not llm.llm_engine.engine_core.compile_pending():
                break
            run_once()
    before = _spec_counts(llm, engine) if spec["speculative_config"] else (0, 0, 0)
    run_s, tokens = [], []
    for _ in range(spec["runs"]):
        start = time.perf_counter()
        tokens.append(run_once())
        run_s.append(time.perf_counter() - start)
    after = _spec_counts(llm, engine) if spec["speculative_config"] else (0, 0, 0)
    drafts, drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
    with open(spec["out"], "w") as f:
        json.dump({"load_s": load_s, "run_s": run_s, "tokens": tokens, "verifications": drafts,
                   "drafted": drafted, "accepted": accepted}, f)  # fmt: skip


# ---- the parent ----


def method_config(method: str, args: argparse.Namespace) -> dict[str, Any] | None:
    k = args.num_speculative_tokens
    if method == "off":
        return None
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
    if method == "eagle3":
        return {"method": "eagle3", "model": args.eagle3_head, "num_speculative_tokens": k}
    if method == "draft_model":
        return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    raise ValueError(method)


def runs_of(workload: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """(engine, method) pairs measured for a workload."""
    if workload in ("edit", "batch"):
        methods = ["off", "ngram"]
    else:
        methods = (
            ["off"] + (["eagle3"] if args.eagle3_head else []) + (["draft_model"] if args.draft_model else [])
        )
    return [(e, m) for e in args.engines.split(",") for m in methods]


def run_worker(workload: str, engine: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    stem = os.path.join(args.log_dir, f"{workload}-{engine}-{method}")
    folder = args.model or model_folder("smollm2")
    spec = {
        "engine": engine, "workload": workload, "folder": folder, "dtype": args.dtype, "runs": args.runs,
        "max_tokens": args.max_tokens, "speculative_config": method_config(method, args),
    }  # fmt: skip
    python = sys.executable if engine == "axon" else args.vllm_python
    env = dict(os.environ) if engine == "axon" else vllm_cpu_env(args.vllm_python)
    out = run_json_worker([python, THIS_FILE, "--worker"], spec, stem, env, REPO_ROOT, args.worker_timeout)
    return {"error": out} if isinstance(out, str) else out


def tok_s(result: dict[str, Any]) -> float:
    return statistics.median(t / s for t, s in zip(result["tokens"], result["run_s"], strict=True))


def rows_of(workload: str, results: dict[tuple[str, str], dict[str, Any]]) -> list[list[str]]:
    rows = []
    for (engine, method), r in results.items():
        if "error" in r:
            rows.append([workload, engine, method, "failed", "", "", r["error"]])
            continue
        speed = tok_s(r)
        mal = 1 + r["accepted"] / r["verifications"] if r.get("verifications") else None
        own_off = results.get((engine, "off"))
        vs_off = (
            f"{speed / tok_s(own_off):.2f}x" if own_off and "error" not in own_off and method != "off" else ""
        )
        vllm_same = results.get(("vllm", method))
        vs_vllm = (
            f"{speed / tok_s(vllm_same):.2f}x"
            if engine == "axon" and vllm_same and "error" not in vllm_same
            else ""
        )
        rows.append([workload, engine, method, f"{speed:.1f}", f"{mal:.2f}" if mal else "", vs_off, vs_vllm])
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="edit,batch", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--engines", default="axon,vllm")
    p.add_argument("--model", default=None, help="target folder (default: the bundled SmolLM2)")
    p.add_argument("--eagle3-head", default=None, help="an EAGLE3 head folder (axon train-eagle3 --output)")
    p.add_argument("--draft-model", default=None, help="a draft model folder sharing the target's tokenizer")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument(
        "--max-tokens", type=int, default=512, help="per single-stream request (it may stop earlier)"
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, metavar="PATH", help="also write every measurement here")
    args = p.parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="axon-spec-bench-")
    os.makedirs(args.log_dir, exist_ok=True)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
        return
    args = parse_args(argv)
    print(f"{cpu_summary()}; {args.dtype}, greedy; k={args.num_speculative_tokens}; median of {args.runs} "
          f"runs after one warm-up; logs in {args.log_dir}", flush=True)  # fmt: skip
    rows, record = [], {}
    for workload in args.workloads.split(","):
        results = {}
        for engine, method in runs_of(workload, args):
            results[(engine, method)] = run_worker(workload, engine, method, args)
            print(f"  {workload} {engine} {method}: {results[(engine, method)]}", flush=True)
        rows += rows_of(workload, results)
        record[workload] = {f"{e}/{m}": r for (e, m), r in results.items()}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
    print()
    print(markdown_table(
        ["workload", "engine", "method", "output tok/s", "mean acceptance length", "vs own off", "axon/vLLM"], rows
    ))  # fmt: skip


if __name__ == "__main__":
    main()
