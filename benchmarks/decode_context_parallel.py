"""Decode context parallelism: TP=2 with and without DCP=2 on one host, one long sequence.

    python -m benchmarks.decode_context_parallel                           # contexts 2048 and 8192
    python -m benchmarks.decode_context_parallel --contexts 1024 --runs 1  # a quick try

The model is a seeded random-weight Llama with one KV head (multi-query attention, as Falcon and
StarCoder; hidden 1024, 16 heads of 64, 8 layers): at TP=2 both ranks hold that KV head, whole
(TP) or every other position of it (DCP). Per configuration, in its own process: the KV cache's
capacity in tokens for the same ``--kv-gib`` per rank, and for each context length a request's
time to first token (its prefill steps) and its decode steps' median (TPOT), the median of
``--runs`` requests, prefix caching off, every bucket compiled before the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import markdown_table

MQA_SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel_size": 2},
    "tp2-dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
}


def mqa_llama_folder() -> str:
    folder = os.path.join(common.bench_cache_root(), "mqa-llama")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        from transformers import LlamaConfig

        config = LlamaConfig(**MQA_SHAPE, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        common._build_random(config, folder)
    return folder


def worker(spec_path: str) -> None:
    """One configuration: its KV capacity and each context's TTFT and TPOT, as JSON."""
    from axon import SamplingParams
    from axon.engine.arg_utils import create_engine_config
    from axon.engine.llm_engine import LLMEngine

    with open(spec_path) as f:
        spec = json.load(f)
    max_len = max(spec["contexts"]) + spec["output_len"]
    config = create_engine_config(
        model=spec["folder"],
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_seqs=1,
        kv_cache_space_gib=spec["kv_gib"],
        enable_prefix_caching=False,
        bucket_compile="warmup",  # every step in a compiled graph, as a warmed-up server runs them
        **spec["options"],
    )
    engine = LLMEngine(config)
    core = engine.engine_core
    result: dict[str, Any] = {"capacity": (core.num_blocks - 1) * config.scheduler_block_size, "contexts": {}}
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    vocab = common.vocab_size(spec["folder"])
    for length in spec["contexts"]:
        prefill_steps = -(-length // config.scheduler_config.max_num_batched_tokens)
        ttft, tpot = [], []
        for run in range(spec["runs"] + 1):  # the first warms up (and compiles) this length
            prompt = common.random_prompts(1, length, vocab, seed=run)[0]
            engine.add_request({"prompt_token_ids": prompt}, params)
            steps = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            if run:
                ttft.append(sum(steps[:prefill_steps]))
                tpot.append(statistics.median(steps[prefill_steps:]))
        result["contexts"][str(length)] = {
            "ttft_s": statistics.median(ttft),
            "tpot_s": statistics.median(tpot),
        }
    core.shutdown()
    with open(spec["out"], "w") as f:
        json.dump(result, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kv-gib", type=float, default=0.25)
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args()
    folder = mqa_llama_folder()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"CPU: {common.cpu_summary()}; bfloat16, greedy, median of {args.runs} requests", flush=True)
    results: dict[str, dict[str, Any]] = {}
    work = os.path.join(common.bench_cache_root(), "dcp-runs")
    os.makedirs(work, exist_ok=True)
    for name in args.configs.split(","):
        spec = {
            "folder": folder,
            "contexts": contexts,
            "output_len": args.output_len,
            "runs": args.runs,
            "kv_gib": args.kv_gib,
            "options": CONFIGS[name],
        }
        cmd = [sys.executable, "-m", "benchmarks.decode_context_parallel", "--worker"]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        got = common.run_json_worker(
            cmd, spec, os.path.join(work, name), dict(os.environ), root, timeout=3600
        )
        if isinstance(got, str):
            print(f"[{name}] FAILED: {got}", flush=True)
            continue
        results[name] = got
        print(f"[{name}] {json.dumps(got)}", flush=True)
    rows = []
    for name, got in results.items():
        cells = [name, f"{got['capacity']:,}"]
        for length in contexts:
            c = got["contexts"][str(length)]
            cells += [f"{c['ttft_s']:.2f}", f"{1e3 * c['tpot_s']:.1f}"]
        rows.append(cells)
    header = ["config", f"KV capacity (tokens, {args.kv_gib:g} GiB/rank)"]
    for length in contexts:
        header += [f"TTFT s @{length}", f"TPOT ms @{length}"]
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
