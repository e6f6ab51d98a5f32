"""LoRA adapters beside the base model: the issue's workload on the bundled SmolLM2-135M.

    python -m benchmarks.lora [--runs 3] [--rank 16] [--vllm-python /tmp/vllm-venv/bin/python]

Four random PEFT adapters (rank ``--rank``, every q/k/v/o/gate/up/down target, built once with
peft) and the base model share one batch of 16 requests (three requests per adapter, four on
the base model), each 128 random prompt tokens -> 128 tokens, greedy, EOS ignored, bfloat16,
``LLM.generate`` with prefix caching off. Compared in the same process with the same 16
prompts on the base model alone (the same engine, ``enable_lora`` on, no adapter), and on an
engine without ``enable_lora``. Output tokens per second, the median of ``--runs`` runs after a
warm-up run each; the engines alternate run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    bench_cache_root,
    cpu_summary,
    markdown_table,
    random_prompts,
    run_json_worker,
    smollm2_folder,
    vllm_cpu_env,
)

NUM_ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(base: str, rank: int) -> list[str]:
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    folders = [os.path.join(bench_cache_root(), f"smollm2-lora-r{rank}-{i}") for i in range(NUM_ADAPTERS)]
    for i, folder in enumerate(folders):
        if os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
            continue
        torch.manual_seed(i)
        model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
        peft_model.save_pretrained(folder)
    return folders


def vllm_worker(spec_path: str) -> None:
    """In vLLM's venv: the mixed batch and the base model alone, tok/s per timed run."""
    import time as clock

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["base"], dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=16, max_model_len=1024,
        enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=spec["rank"],
    )  # fmt: skip
    loras = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(spec["folders"])]
    mixes = {"base": [None] * 16, "mixed": [lo for lo in loras for _ in range(3)] + [None] * 4}
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    out: dict[str, list[float]] = {name: [] for name in mixes}
    for r in range(spec["runs"] + 1):
        for name, mix in mixes.items():
            t0 = clock.perf_counter()
            llm.generate(prompts, params, lora_request=mix, use_tqdm=False)
            if r > 0:
                out[name].append(16 * 128 / (clock.perf_counter() - t0))
    with open(spec["out"], "w") as f:
        json.dump(out, f)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--vllm-python", default=None, help="vLLM's venv python: run it beside axon")
    args = parser.parse_args()
    from axon import LLM, LoRARequest, SamplingParams
    from benchmarks.common import vocab_size

    print(cpu_summary())
    base = smollm2_folder()
    folders = adapters(base, args.rank)
    loras = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders)]
    mix = [lo for lo in loras for _ in range(3)] + [None] * 4
    prompts = [{"prompt_token_ids": p} for p in random_prompts(16, 128, vocab_size(base), seed=0)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    common = {"model": base, "dtype": "bfloat16", "enable_prefix_caching": False, "max_num_seqs": 16}
    engines = {
        "no LoRA engine": (LLM(**common), [None] * 16),
        "LoRA engine, base only": (
            lora_llm := LLM(**common, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank),
            [None] * 16,
        ),
        f"LoRA engine, {NUM_ADAPTERS} adapters + base": (lora_llm, mix),
    }
    results: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.runs + 1):
        for name, (llm, lora_list) in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_list)
            elapsed = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == 128 for o in outs)
            if r > 0:
                results[name].append(16 * 128 / elapsed)
            print(f"run {r} {name}: {16 * 128 / elapsed:.1f} tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in results.items()}
    plain = medians["no LoRA engine"]
    rows = [[name, f"{m:.1f}", f"{m / plain:.2f}x"] for name, m in medians.items()]
    print(markdown_table(["engine, batch of 16", "output tok/s (median)", "vs no LoRA"], rows))
    mixed = medians[f"LoRA engine, {NUM_ADAPTERS} adapters + base"]
    print(f"{NUM_ADAPTERS} adapters + base / base alone: {mixed / plain:.2f}x (target >= 0.85x)")
    if args.vllm_python:
        del engines, lora_llm, llm  # their threads and memory, before vLLM starts
        spec = {"base": base, "folders": folders, "rank": args.rank, "runs": args.runs,
                "prompts": [p["prompt_token_ids"] for p in prompts]}  # fmt: skip
        stem = os.path.join(bench_cache_root(), "lora-vllm")
        this = os.path.abspath(__file__)
        env = vllm_cpu_env(args.vllm_python)
        got = run_json_worker([args.vllm_python, this, "--vllm-worker"], spec, stem, env, os.getcwd(), 1800)
        if isinstance(got, str):
            print(f"vLLM: failed ({got})")
            return
        vllm = {name: statistics.median(v) for name, v in got.items()}
        base_only = medians["LoRA engine, base only"]
        rows = [
            [
                "base only (LoRA on)",
                f"{base_only:.1f}",
                f"{vllm['base']:.1f}",
                f"{base_only / vllm['base']:.2f}x",
            ],
            [
                f"{NUM_ADAPTERS} adapters + base",
                f"{mixed:.1f}",
                f"{vllm['mixed']:.1f}",
                f"{mixed / vllm['mixed']:.2f}x",
            ],
        ]
        print(markdown_table(["batch of 16", "axon tok/s", "vLLM tok/s", "axon / vLLM"], rows))
        print(
            f"axon / vLLM with {NUM_ADAPTERS} adapters + base: {mixed / vllm['mixed']:.2f}x (target >= 1.2x)"
        )


if __name__ == "__main__":
    main()
