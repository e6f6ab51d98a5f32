"""Qwen3-VL serving throughput and the encoder cache: axon beside transformers.

    python -m benchmarks.multimodal [--runs 3] [--num-requests 8] [--engines axon,transformers]

The model is a seeded random Qwen3-VL shaped like Qwen3-VL-2B-Instruct (``benchmarks.common``:
28 decoder layers of 2048, a 24-block vision tower of 1024 with deepstack at 5, 11, 17; SmolLM2's
vocabulary instead of Qwen's), bfloat16. Workload (the issue's): ``--num-requests`` requests at
once, each one 448 x 448 image (its own random pixels: 196 image tokens) and 64 random text
tokens -> 64 tokens, greedy, EOS ignored. axon runs them through ``LLM.generate`` (prefix caching
off); transformers as one batch through ``generate`` (all prompts have the same length, so no
padding). Output tokens per second, the median of ``--runs`` runs after one warm-up run on other
images.

Then axon's time to first token (a one-token request) for an image seen for the first time,
and for the same image again with another question: with prefix caching off (only the encoder
cache saves work: the vision tower is skipped) and on (the image's prompt blocks hit too).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from benchmarks.common import VISION_TOKENS, cpu_summary, markdown_table, qwen3_vl_folder

IMAGE_SIDE = 448
TEXT_LEN = 64
OUTPUT_LEN = 64


def _images(n: int, seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)) for _ in range(n)
    ]


def _prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Per request: the image's placeholder between vision start and end, then 64 text ids."""
    start, end, pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    rng = np.random.default_rng(seed)
    return [[start, pad, end, *rng.integers(100, 40000, TEXT_LEN).tolist()] for _ in range(n)]


def run_axon(folder: str, n: int, runs: int) -> tuple[list[float], list[tuple[str, float, float]]]:
    from axon import LLM, SamplingParams

    llm = LLM(model=folder, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False, max_num_seqs=n)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    times = []
    for r in range(runs + 1):
        images = _images(n, seed=100 + r)
        prompts = [{"prompt_token_ids": p, "multi_modal_data": {"image": im}}
                   for p, im in zip(_prompts(tokenizer, n, seed=r), images, strict=True)]  # fmt: skip
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outs)
        if r > 0:  # the first run warms up
            times.append(elapsed)
        print(f"[axon] run {r}: {elapsed:.2f} s", flush=True)
        if r == 0:  # the buckets the warm-up reached compile now, not inside the next timed run
            llm.llm_engine.engine_core.compile_pending()
    ttft = []
    for caching in (False, True):
        engine = (
            llm if not caching else LLM(model=folder, dtype="bfloat16", max_model_len=1024, max_num_seqs=n)
        )
        one = SamplingParams(temperature=0, max_tokens=1)
        image = _images(1, seed=999 + caching)[0]
        first, second = _prompts(tokenizer, 2, seed=50)
        seen = []
        for prompt in (first, second):
            t0 = time.perf_counter()
            engine.generate(
                [{"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}], one, use_tqdm=False
            )
            seen.append(time.perf_counter() - t0)
        ttft.append(("on" if caching else "off", seen[0], seen[1]))
        print(
            f"[axon] TTFT prefix caching {ttft[-1][0]}: first {seen[0]:.3f} s, same image again {seen[1]:.3f} s"
        )
    return times, ttft


def run_transformers(folder: str, n: int, runs: int) -> list[float]:
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)  # fmt: skip
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    times = []
    for r in range(runs + 1):
        images = _images(n, seed=100 + r)
        t0 = time.perf_counter()
        pixels = processor(images=images, return_tensors="pt")
        tokens = int(pixels["image_grid_thw"][0].prod()) // 4
        prompts = [
            [t for tok in p for t in ([pad] * tokens if tok == pad else [tok])]
            for p in _prompts(tokenizer, n, seed=r)
        ]
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == pad).int(),
                pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False,
            )  # fmt: skip
        elapsed = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + OUTPUT_LEN
        if r > 0:
            times.append(elapsed)
        print(f"[transformers] run {r}: {elapsed:.2f} s", flush=True)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--engines", default="axon,transformers")
    args = p.parse_args()
    folder = qwen3_vl_folder()
    engines = args.engines.split(",")
    tok_s, runs_s, ttft = {}, {}, []
    n = args.num_requests
    if "axon" in engines:
        times, ttft = run_axon(folder, n, args.runs)
        runs_s["axon"], tok_s["axon"] = times, n * OUTPUT_LEN / statistics.median(times)
        gc.collect()
    if "transformers" in engines:
        times = run_transformers(folder, n, args.runs)
        runs_s["transformers"], tok_s["transformers"] = times, n * OUTPUT_LEN / statistics.median(times)
    print(cpu_summary())
    print(
        f"Qwen3-VL 2B shape, bf16, {n} x (one {IMAGE_SIDE}x{IMAGE_SIDE} image + {TEXT_LEN} tokens) -> {OUTPUT_LEN}"
    )
    rows = [[e, f"{tok_s[e]:.1f}", "/".join(f"{t:.1f}" for t in runs_s[e])] for e in tok_s]
    print(markdown_table(["engine", "output tok/s", "timed runs (s)"], rows))
    if len(tok_s) == 2:
        print(f"axon/transformers: {tok_s['axon'] / tok_s['transformers']:.2f}x")
    if ttft:
        rows = [[caching, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x"] for caching, a, b in ttft]
        print(
            markdown_table(
                ["prefix caching", "TTFT first (s)", "TTFT same image again (s)", "first / again"], rows
            )
        )


if __name__ == "__main__":
    main()
