"""What batch invariance costs, and what it buys: vs_peers' workloads run by axon with batch-
invariant attention (the default) and with the few-rows path for short items
(``AXON_BATCH_INVARIANT=0``, a setting that is not invariant), the two settings
alternating so that a noisy machine hits both alike; then the same 24 greedy prompts alone and
all at once, their logprobs compared exactly, in each setting.

    python -m benchmarks.batch_invariance                     # (a), (b), (c), (d), 2 rounds
    python -m benchmarks.batch_invariance --workloads b --rounds 1 --runs 1   # a quick try
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import vs_peers
from benchmarks.common import cpu_summary, markdown_table

SETTINGS = {"invariant": "1", "few-rows": "0"}

_CHECK = textwrap.dedent(
    """
    from axon import LLM, SamplingParams
    words = "cat dog robot king baker pilot whale child wizard farmer sailor poet doctor spider giant miner singer thief nurse clown owl fox monk queen".split()
    prompts = [f"Write a short story number {i} about a {w} who" + " and then" * (i % 5) * 7 for i, w in enumerate(words)]
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=0)
    llm = LLM(dtype="bfloat16", enable_prefix_caching=True)
    def run(ps):
        return [[(t, next(iter(d.values())).logprob) for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in llm.generate(ps, params, use_tqdm=False)]
    alone = [run([p])[0] for p in prompts]
    together = run(prompts)
    again = run(prompts)  # every prompt now a prefix-cache hit
    same = lambda xs: sum(a == b for a, b in zip(alone, xs))
    print(f"{same(together)}/{len(prompts)} {same(again)}/{len(prompts)}")
    """
)


def determinism(setting: str) -> str:
    env = {**os.environ, "AXON_BATCH_INVARIANT": SETTINGS[setting]}
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="a,b,c,d")
    p.add_argument(
        "--rounds", type=int, default=2, help="times each setting runs each workload (alternating)"
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs per round after one warm-up (vs_peers')")
    args = p.parse_args()
    peers_args = vs_peers.parse_args(
        ["--engines", "axon", "--workloads", args.workloads, "--runs", str(args.runs), "--dtype", "bfloat16"]
    )
    print(cpu_summary(), flush=True)
    # (workload, metric) -> setting -> one value per round
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    for w in vs_peers.chosen_workloads(peers_args):
        for _ in range(args.rounds):
            for setting, env in SETTINGS.items():
                os.environ["AXON_BATCH_INVARIANT"] = env
                runs = vs_peers.bench_workload(w, peers_args)
                if runs["axon"].error:
                    raise SystemExit(f"{w.name} ({setting}): {runs['axon'].error}")
                for row in vs_peers.workload_rows(w, runs, None):
                    values.setdefault((row.workload, row.metric), {}).setdefault(setting, []).append(
                        row.values["axon"]
                    )
                    print(f"{row.workload} | {row.metric} | {setting} {row.values['axon']:.2f}", flush=True)
    os.environ.pop("AXON_BATCH_INVARIANT")
    rows = []
    for (workload, metric), by in values.items():
        inv, few = statistics.median(by["invariant"]), statistics.median(by["few-rows"])
        higher_better = "higher is better" in metric
        cost = (few / inv - 1) if higher_better else (inv / few - 1)
        rows.append([workload, metric, f"{inv:,.2f}", f"{few:,.2f}", f"{cost:+.1%}"])
    print()
    print(
        markdown_table(
            [
                "workload",
                "metric",
                "invariant (default)",
                "few-rows (AXON_BATCH_INVARIANT=0)",
                "cost of invariance",
            ],
            rows,
        )
    )
    print()
    print(
        markdown_table(
            [
                "setting",
                "24 prompts: alone == all at once (exact logprobs)",
                "alone == after a prefix-cache hit",
            ],
            [[s, *determinism(s).split()] for s in SETTINGS],
        )
    )


if __name__ == "__main__":
    main()
