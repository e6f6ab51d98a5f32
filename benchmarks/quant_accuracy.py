"""Accuracy of quantized weights and of the FP8 KV cache against bfloat16, teacher-forced.

    python -m benchmarks.quant_accuracy [--positions 2000] [--configs gguf,int8,int4,fp8,kv_fp8]

SmolLM2-135M-Instruct (the bundled model) reads the same English text (docstrings of Python's
standard library, in fixed order, cut into prompts of 500 tokens) in each configuration, with
``prompt_logprobs=20``: at every position, the 20 most likely next tokens and their logprobs.
Against the baseline (bf16 weights dequantized from the GGUF file, bf16 KV cache) it reports

- top-1 agreement: the share of positions whose most likely token is the baseline's;
- mean KL(baseline || config) over the baseline's top 20 tokens at each position (a token the
  config does not list gets the config's 20th logprob, an upper bound on its probability);

and ``gguf`` (the same file kept quantized) against its own dequantized self, the baseline.
``fp32`` (the same dequantized weights in float32, exact) shows how much of a disagreement is
bf16's own rounding: the baseline rounds each dequantized weight to bf16, while the quantized
GEMM multiplies by the exact codes and applies the float32 scales after each group's sum.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import math

from benchmarks.common import cpu_summary, markdown_table

CONFIGS = {
    "fp32": {"dtype": "float32"},  # the GGUF's exact dequantized weights: how far bf16 itself is
    "gguf": {"quantization": "gguf"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int4-g32": {"quantization": "int4", "quantization_group_size": 32},
    "fp8": {"quantization": "fp8"},
    "w8a8": {"quantization": "w8a8"},
    "kv_fp8": {"kv_cache_dtype": "fp8"},
    "kv_fp8_calc": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
}
TEXT_MODULES = (
    "json",
    "argparse",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "subprocess",
    "typing",
)
PROMPT_TOKENS = 500


def corpus() -> str:
    docs = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
                docs.append(inspect.getdoc(obj) or "")
    return "\n\n".join(d for d in docs if d)


def prompts(positions: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from axon.engine.arg_utils import create_engine_config

    tokenizer = AutoTokenizer.from_pretrained(create_engine_config().model_config.tokenizer)
    ids = tokenizer(corpus())["input_ids"]
    count = -(-(positions + 1) // PROMPT_TOKENS)
    assert len(ids) >= count * PROMPT_TOKENS, "the corpus is shorter than the positions asked for"
    return [ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(count)]


def top_logprobs(options: dict, token_prompts: list[list[int]], positions: int) -> list[dict[int, float]]:
    """Per position (after the first token of each prompt), token id -> logprob of the top 20."""
    from axon import LLM
    from axon.sampling_params import SamplingParams

    options = {"dtype": "bfloat16", **options}
    llm = LLM(max_model_len=1024, enable_prefix_caching=False, **options)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20)
    outputs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params)
    rows: list[dict[int, float]] = []
    for out in outputs:
        for entry in out.prompt_logprobs[1:]:  # position 0 has no prediction
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:20]
            rows.append({token: lp.logprob for token, lp in ranked})
    del llm
    gc.collect()
    return rows[:positions]


def compare(base: list[dict[int, float]], other: list[dict[int, float]]) -> tuple[float, float]:
    agree, kl = 0, 0.0
    for b, o in zip(base, other, strict=True):
        agree += max(b, key=b.get) == max(o, key=o.get)
        floor = min(o.values())
        kl += sum(math.exp(lp) * (lp - o.get(token, floor)) for token, lp in b.items())
    return agree / len(base), kl / len(base)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=2000)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument(
        "--baseline", default="bf16", choices=["bf16", "fp32"], help="what the configs are compared with"
    )
    args = parser.parse_args()
    token_prompts = prompts(args.positions)
    base = top_logprobs({} if args.baseline == "bf16" else CONFIGS["fp32"], token_prompts, args.positions)
    rows = []
    for name in args.configs.split(","):
        agreement, kl = compare(base, top_logprobs(CONFIGS[name], token_prompts, args.positions))
        rows.append(
            [
                name,
                " ".join(f"{k}={v}" for k, v in CONFIGS[name].items()),
                f"{100 * agreement:.2f}%",
                f"{kl:.4f}",
            ]
        )
        print(f"{name}: top-1 agreement {100 * agreement:.2f}%, mean KL {kl:.4f}", flush=True)
    print(
        f"\n{cpu_summary()}; {len(base)} positions of SmolLM2-135M-Instruct against {args.baseline} weights and KV\n"
    )
    print(markdown_table(["config", "options", "top-1 agreement", "mean KL (top 20)"], rows))


if __name__ == "__main__":
    main()
