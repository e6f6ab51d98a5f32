"""Microseconds per mixture-of-experts block: axon's fused CPU op beside the loop over experts.

    python -m benchmarks.moe_op [--reps 9] [--threads 2] [--layers 12]

One sparse block of the MoE workload's model (``benchmarks.common.QWEN3_MOE_SHAPE``: hidden 1024,
16 experts of 512, 4 per token), Qwen3-MoE's and GPT-OSS's (its routing, biases and swigluoai), bfloat16, random weights and router logits, at 1 token (a
single decode), 16 (a batch-16 decode step), 128 and 512 tokens (prefills). ``loop`` is
``axon.model.layers.moe.moe_loop``, transformers' way (one ``F.linear`` pair per picked expert,
``index_add_``); ``fused`` is ``torch.ops.axon_cpu.fused_moe`` on the packed weights. Medians of
``--reps`` calls after two warm-up calls, all timed round-robin. ``int8`` and ``int4`` are
``fused_moe_quant`` on the same experts kept as codes (``--quantization int8`` / ``int4``: per
output channel, and per group of 128 inputs with a min), where the CPU runs axon's quantized
kernel (AVX-512 BF16 and VBMI). Each timed call runs the tokens through ``--layers`` blocks with
their own weights (the model's 12 layers: 576 MiB of bf16 experts, far past any cache, as a
decode step streams them), and the table gives microseconds per block.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.attention_micro import median_us_each
from benchmarks.common import QWEN3_MOE_SHAPE, cpu_summary, markdown_table

TOKENS = (1, 16, 128, 512)
QUANT_METHODS = ("int8", "int4")


def _through(blocks: list, x: torch.Tensor, logits: torch.Tensor) -> None:
    """x through every block (same input each: only the weights' stream matters here)."""
    for block in blocks:
        block(x, logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--layers", type=int, default=12, help="blocks per timed call, each with its own weights"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from axon.config import default_cache_root
    from axon.model.layers.moe import FusedMoE, MoeMath
    from axon.model.layers.quant import quant_kernel_supported, quantize_experts
    from axon.platforms.cpu_kernels import load_cpu_kernels

    if not (load_cpu_kernels(default_cache_root()) and torch.ops.axon_cpu.linear_supported()):
        raise SystemExit("the fused MoE op needs axon's C++ kernels on a CPU with AVX-512 BF16")
    shape = QWEN3_MOE_SHAPE
    hidden, experts, top_k = shape["hidden_size"], shape["num_experts"], shape["num_experts_per_tok"]
    width = shape["moe_intermediate_size"]
    blocks = {  # the block of each model family, on the same shape
        "qwen3_moe": (MoeMath(top_k, renormalize=True), False),
        "gpt_oss": (MoeMath(top_k, routing="topk_softmax", activation="swigluoai"), True),
    }
    gen = torch.Generator().manual_seed(0)
    methods = QUANT_METHODS if quant_kernel_supported() else ()
    rows = []
    with torch.inference_mode():
        for family, (math, bias) in blocks.items():
            forms: dict[str, list[FusedMoE]] = {"loop": [], "fused": [], **{m: [] for m in methods}}
            for _ in range(args.layers):
                loop = FusedMoE(experts, hidden, width, math, bias=bias)
                for p in loop.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                loop = loop.bfloat16()
                forms["loop"].append(loop)
                for form in ("fused", *methods):
                    block = FusedMoE(experts, hidden, width, math, bias=bias).bfloat16()
                    block.load_state_dict(loop.state_dict())
                    if form == "fused":
                        block.pack()
                    else:
                        quantize_experts(block, form, None, use_kernel=True)
                    forms[form].append(block)
            for tokens in TOKENS:
                x = torch.randn(tokens, hidden, generator=gen).bfloat16()
                logits = torch.randn(tokens, experts, generator=gen).bfloat16()
                calls = [functools.partial(_through, blocks, x, logits) for blocks in forms.values()]
                loop_us, fused_us, *quant_us = (us / args.layers for us in median_us_each(calls, args.reps))
                speedup = f"{loop_us / fused_us:.1f}x"
                rows.append(
                    [family, str(tokens), f"{loop_us:,.0f}", f"{fused_us:,.0f}", speedup]
                    + [f"{us:,.0f} ({fused_us / us:.1f}x)" for us in quant_us]
                    + ["-"] * (len(QUANT_METHODS) - len(quant_us))
                )
            del forms
    print(cpu_summary())
    print(
        f"one MoE block: hidden {hidden}, {experts} experts of {width}, top-{top_k}, bf16, "
        f"{args.threads} threads, median of {args.reps}, per block of {args.layers} run in turn"
    )
    quant_cols = [f"{m} us (vs fused bf16)" for m in QUANT_METHODS]
    print(markdown_table(["block", "tokens", "loop us", "fused us", "fused speedup", *quant_cols], rows))


if __name__ == "__main__":
    main()
