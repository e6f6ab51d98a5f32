"""Side by side: axon, vLLM's CPU build, transformers and OpenVINO GenAI on the same fixed workloads.

Each engine runs each workload in its own subprocess (so memory is freed and one engine cannot
disturb another): load once, one warm-up, then ``--runs`` timed runs; the median is reported in
ONE table with the ratios axon/vllm, axon/transformers and axon/openvino and, for the batch-16
workloads, the fraction of the memory-bandwidth floor each engine reaches.

    python -m benchmarks.vs_peers                                     # everything, ~20 minutes
    python -m benchmarks.vs_peers --workloads a --engines axon,transformers --runs 1 \\
        --num-prompts 4 --output-len 16                               # a quick try
    python -m benchmarks.vs_peers --workloads a,b --axon-args '{"enforce_eager": true}'

vLLM runs ``LLM.generate`` from its own virtual environment (``--vllm-python``), through this same
file as the driver, with the environment of ``benchmarks.common.vllm_cpu_env``. OpenVINO GenAI runs
the same way from ``--openvino-python``, on an IR exported once per model with that venv's
``optimum-cli`` and kept under ``<bench cache root>/openvino``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Only the standard library and benchmarks.common at import time: vLLM's and OpenVINO's Pythons
# run this file too.
from benchmarks.common import (
    ThroughputResult,
    bench_cache_root,
    markdown_table,
    model_folder,
    random_prompts,
    run_json_worker,
    time_call,
    vllm_cpu_env,
    vocab_size,
)

THIS_FILE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(THIS_FILE))
PROMPT_SEED = 0
MAX_MODEL_LEN = 2048
ENGINE_NAMES = ("axon", "vllm", "transformers", "openvino")
FIRST_TOKEN_MARK = "VS_PEERS_FIRST_TOKEN"
# --dtype -> OpenVINO's precision name, for the CPU plugin's inference and KV-cache precision.
OPENVINO_PRECISIONS = {"bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "f32", "float": "f32"}
OPENVINO_VENV_HELP = (
    "create it with: python -m venv /tmp/ov-venv && /tmp/ov-venv/bin/pip install torch==2.13.0 && "
    "echo torch==2.13.0+cpu > /tmp/ov-torch.txt && PIP_CONSTRAINT=/tmp/ov-torch.txt "
    "/tmp/ov-venv/bin/pip install openvino-genai 'optimum-intel[openvino]' && "
    "/tmp/ov-venv/bin/pip uninstall -y torchvision (see benchmarks/README.md)"
)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # a benchmarks.common model name
    kind: str  # throughput (tok/s) | latency (TPOT, TTFT) | startup (process start -> first token)
    num_prompts: int
    input_len: int
    output_len: int
    engines: tuple[str, ...]


WORKLOADS: dict[str, Workload] = {
    "a": Workload("a", "tiny", "throughput", 16, 128, 128, ENGINE_NAMES),
    "b": Workload("b", "smollm2", "throughput", 16, 128, 128, ENGINE_NAMES),
    "c": Workload("c", "smollm2", "throughput", 64, 512, 128, ("axon", "vllm", "openvino")),
    "d": Workload("d", "smollm2", "latency", 1, 128, 256, ("axon", "vllm", "openvino")),
    "e": Workload("e", "smollm2", "startup", 1, 128, 1, ("axon", "vllm")),
    # Mixture of experts: a random Qwen3-MoE and GPT-OSS (benchmarks.common.QWEN3_MOE_SHAPE,
    # GPT_OSS_SHAPE); not in the default set.
    "f": Workload("f", "qwen3_moe", "throughput", 16, 128, 128, ("axon", "vllm", "transformers")),
    "g": Workload("g", "gpt_oss", "throughput", 16, 128, 128, ("axon", "vllm", "transformers")),
}


# ---- engines: each is built inside its worker process, from that engine's Python ----


class VllmEngine:
    def __init__(self, folder: str, dtype: str, max_num_seqs: int | None, extra: dict[str, Any]) -> None:
        del extra  # --axon-args are axon's
        from vllm import LLM

        seqs = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
        self.llm = LLM(
            model=folder, dtype=dtype, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, **seqs
        )

    def generate(self, prompts: list[list[int]], output_len: int) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]


class OpenvinoEngine:
    """OpenVINO GenAI on the CPU, from an exported IR folder: ``ContinuousBatchingPipeline`` for the
    batch workloads (a scheduler like axon's and vLLM's), ``LLMPipeline`` for one request alone
    (the API OpenVINO offers for a single stream)."""

    def __init__(self, folder: str, dtype: str, max_num_seqs: int | None, kind: str, weights: str = "auto") -> None:
        import openvino as ov
        import openvino_genai as ov_genai

        if dtype not in OPENVINO_PRECISIONS:
            raise ValueError(f"--dtype {dtype!r}: OpenVINO runs {', '.join(OPENVINO_PRECISIONS)}")
        precision = OPENVINO_PRECISIONS[dtype]
        # The fp16 IR asks for an f16 KV cache (its rt_info), and the CPU plugin computes in bf16
        # only where it finds AVX-512 BF16: ask for --dtype in both, as the other engines run.
        # The int8 export keeps its own KV precision (u8) and activation quantization.
        props = {"INFERENCE_PRECISION_HINT": precision}
        if weights != "int8":
            props["KV_CACHE_PRECISION"] = precision
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False  # the timed runs repeat the warm-up's prompts
        if max_num_seqs is not None:
            scheduler.max_num_seqs = max_num_seqs
        self.single = kind == "latency"
        if self.single:
            scheduler.max_num_batched_tokens = MAX_MODEL_LEN  # LLMPipeline's own default: one prefill
            self.pipe = ov_genai.LLMPipeline(folder, "CPU", scheduler_config=scheduler, **props)
        else:
            self.pipe = ov_genai.ContinuousBatchingPipeline(folder, scheduler, "CPU", props)
        # The plugin ignores a precision hint the CPU cannot run: say what ran, not what was asked.
        cap = {"bf16": "BF16", "f16": "FP16", "f32": "FP32"}[precision]
        supported = cap in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        ran = precision if supported else f"the plugin's default ({precision} asked; the CPU lacks {cap})"
        version = ov.get_version().split("-")[0]
        self.note = f"OpenVINO {version}, {os.path.basename(folder)} IR, compute and KV cache {ran}"

    def generate(self, prompts: list[list[int]], output_len: int) -> list[int]:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig(
            max_new_tokens=output_len, min_new_tokens=output_len, ignore_eos=True, do_sample=False
        )
        inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]  # [1, len] each
        if self.single:
            return [len(self.pipe.generate(i, config).tokens[0]) for i in inputs]
        results = self.pipe.generate(inputs, [config] * len(inputs))
        return [len(r.m_generation_ids[0]) for r in results]


def make_engine(spec: dict[str, Any]) -> Any:
    args = (spec["folder"], spec["dtype"], spec["max_num_seqs"], spec["axon_args"])
    if spec["engine"] == "vllm":
        return VllmEngine(*args)
    if spec["engine"] == "openvino":
        return OpenvinoEngine(*args[:3], spec["kind"], spec.get("openvino_weights", "auto"))
    # Imported here: vLLM's and OpenVINO's Pythons run this file too, and have no axon.
    from benchmarks.offline_throughput import AxonEngine, TransformersEngine

    if spec["engine"] == "axon":
        return AxonEngine(*args)
    return TransformersEngine(*args[:3])  # batched HF generate, no padding


def spec_prompts(spec: dict[str, Any]) -> list[list[int]]:
    vocab = vocab_size(spec["folder"])
    return random_prompts(spec["num_prompts"], spec["input_len"], vocab, PROMPT_SEED)


def worker_main(spec_path: str) -> None:
    """Load, warm up, time; write {load_s, run_s, ttft_s, note, lengths_ok} to spec["out"]."""
    with open(spec_path) as f:
        spec = json.load(f)
    prompts, output_len = spec_prompts(spec), spec["output_len"]
    start = time.perf_counter()
    engine = make_engine(spec)
    load_s = time.perf_counter() - start
    lengths = engine.generate(prompts, output_len)  # warm-up
    lengths_ok = all(n == output_len for n in lengths)
    run_s: list[float] = []
    ttft_s: list[float] = []
    if spec["kind"] == "latency":
        engine.generate(prompts, 1)  # warm-up of the 1-token run
    settle = getattr(engine, "settle", None)  # axon: compile the buckets the warm-up reached
    settle_s = time_call(settle) if settle is not None else 0.0
    for _ in range(spec["runs"]):
        if spec["kind"] == "latency":
            # TTFT: a separate 1-token run of the same prompt (prefill + first sample + output).
            ttft_s.append(time_call(lambda: engine.generate(prompts, 1)))
        run_s.append(time_call(lambda: engine.generate(prompts, output_len)))
    result = {"load_s": load_s, "settle_s": settle_s, "run_s": run_s, "ttft_s": ttft_s}
    result["note"] = getattr(engine, "note", "")  # OpenVINO: the precision that ran
    result["lengths"] = sorted(set(lengths))
    result["lengths_ok"] = lengths_ok
    with open(spec["out"], "w") as f:
        json.dump(result, f)


def first_token_main(spec_json: str) -> None:
    """The start-up child: build the engine, make one token of one prompt, print the mark."""
    spec = json.loads(spec_json)
    lengths = make_engine(spec).generate(spec_prompts(spec), 1)
    print(f"{FIRST_TOKEN_MARK} {lengths}", flush=True)


# ---- the parent: one subprocess per (workload, engine) ----


@dataclass
class EngineRun:
    workload: str
    engine: str
    load_s: float | None = None
    run_s: list[float] = field(default_factory=list)  # startup: [cold, warm] for axon, [one] for vllm
    ttft_s: list[float] = field(default_factory=list)
    error: str | None = None
    note: str = ""  # what the engine says about how it ran (OpenVINO: its precision)


def engine_python(engine: str, args: argparse.Namespace) -> str:
    return {"vllm": args.vllm_python, "openvino": args.openvino_python}.get(engine, sys.executable)


def engine_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    return vllm_cpu_env(args.vllm_python) if engine == "vllm" else dict(os.environ)


def make_spec(w: Workload, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "engine": engine,
        "kind": w.kind,
        "folder": model_folder(w.model),
        "dtype": args.dtype,
        "num_prompts": w.num_prompts,
        "input_len": w.input_len,
        "output_len": w.output_len,
        # Start-up uses each engine's default; the timed workloads size the batch to the prompts.
        "max_num_seqs": None if w.kind == "startup" else w.num_prompts,
        "runs": args.runs,
        "axon_args": args.axon_args,
        "openvino_weights": getattr(args, "openvino_weights", "auto"),
    }


def openvino_ir(model: str, hf_folder: str, args: argparse.Namespace) -> str:
    """The model's OpenVINO IR folder, exported once with the venv's ``optimum-cli`` (fp32 weights
    for an fp32 run, else fp16) and reused; raises RuntimeError naming what to fix."""
    cli = os.path.join(os.path.dirname(args.openvino_python), "optimum-cli")
    for tool in (args.openvino_python, cli):
        if not os.access(tool, os.X_OK):
            raise RuntimeError(f"--openvino-python: {tool!r} is not an executable; {OPENVINO_VENV_HELP}")
    weight_format = "fp32" if OPENVINO_PRECISIONS.get(args.dtype) == "f32" else "fp16"
    if args.openvino_weights == "int8":
        weight_format = "int8"
    folder = os.path.join(bench_cache_root(), "openvino", f"{model}-{weight_format}")
    if os.path.isfile(os.path.join(folder, "openvino_model.xml")):
        return folder
    # Export to a temporary folder and rename, so an interrupted export never looks finished.
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log_path = os.path.join(args.log_dir, f"openvino-export-{model}-{weight_format}.log")
    cmd = [cli, "export", "openvino", "--model", hf_folder, "--task", "text-generation-with-past"]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [*cmd, "--weight-format", weight_format, tmp], stdout=log, stderr=subprocess.STDOUT,
            cwd=REPO_ROOT, timeout=args.worker_timeout, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"optimum-cli export failed (exit code {proc.returncode}); see {log_path}")
    os.replace(tmp, folder)
    print(f"[openvino] exported {model} to {folder} ({time.perf_counter() - start:.0f} s)", flush=True)
    return folder


def run_worker(w: Workload, engine: str, args: argparse.Namespace) -> EngineRun:
    spec = make_spec(w, engine, args)
    if engine == "openvino":
        try:
            spec["folder"] = openvino_ir(w.model, spec["folder"], args)  # same config.json, same vocab
        except RuntimeError as e:
            return EngineRun(w.name, engine, error=str(e))
    stem = os.path.join(args.log_dir, f"{w.name}-{engine}")
    out = run_json_worker(
        [engine_python(engine, args), THIS_FILE, "--worker"],
        spec,
        stem,
        engine_env(engine, args),
        REPO_ROOT,
        args.worker_timeout,
    )
    if isinstance(out, str):
        return EngineRun(w.name, engine, error=out)
    if not out["lengths_ok"]:
        return EngineRun(w.name, engine, error=f"expected {w.output_len} new tokens, got {out['lengths']}")
    return EngineRun(w.name, engine, out["load_s"], out["run_s"], out["ttft_s"], note=out["note"])


def time_first_token(
    w: Workload, engine: str, args: argparse.Namespace, env: dict[str, str], tag: str
) -> float:
    """Seconds from Popen of a fresh ``python -c`` to the child printing its first token."""
    spec = make_spec(w, engine, args)
    code = (
        f"import sys; sys.path.insert(0, {REPO_ROOT!r}); "
        "from benchmarks.vs_peers import first_token_main; first_token_main(sys.argv[1])"
    )
    log_path = os.path.join(args.log_dir, f"{w.name}-{engine}-{tag}.log")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [engine_python(engine, args), "-c", code, json.dumps(spec)],
            env=env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT,
        )  # fmt: skip
        assert proc.stdout is not None
        elapsed = None
        for line in proc.stdout:
            if elapsed is None and line.startswith(FIRST_TOKEN_MARK):
                elapsed = time.perf_counter() - start
            log.write(line)
        try:
            proc.wait(timeout=args.worker_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    if elapsed is None:
        raise RuntimeError(
            f"{engine} start-up printed no token (exit code {proc.returncode}); see {log_path}"
        )
    return elapsed


def run_startup(w: Workload, engine: str, args: argparse.Namespace) -> EngineRun:
    try:
        if engine == "vllm":
            return EngineRun(
                w.name, engine, run_s=[time_first_token(w, engine, args, engine_env(engine, args), "start")]
            )
        # Cold: a fresh cache root (axon's, and inductor's, should axon compile); warm: the same again.
        root = tempfile.mkdtemp(prefix="vs_peers-axon-cache-")
        env = dict(os.environ, AXON_CACHE_ROOT=root, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"))
        try:
            starts = [time_first_token(w, engine, args, env, tag) for tag in ("cold", "warm")]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return EngineRun(w.name, engine, run_s=starts)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return EngineRun(w.name, engine, error=str(e))


# ---- the memory-bandwidth floor ----


def read_bandwidth_gb_s(gib: float = 1.0, repeats: int = 5) -> float:
    """Median GB/s of ``.sum()`` over a ``gib`` GiB bf16 tensor, on torch's default threads."""
    import torch

    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16)
    x.sum()  # touch the pages once
    times = [time_call(x.sum) for _ in range(repeats)]
    return x.numel() * 2 / statistics.median(times) / 1e9


def safetensors_numel(folder: str) -> dict[str, int]:
    """Tensor name -> element count, from the headers of the folder's safetensors files."""
    numel: dict[str, int] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for key, info in header.items():
                if key != "__metadata__":
                    numel[key] = math.prod(info["shape"])
    return numel


def decode_step_bytes(folder: str, dtype_bytes: int, batch: int, mean_context: float) -> float:
    """Bytes one decode step must read: every weight once (an untied input embedding only gathers
    ``batch`` rows, so it is left out) plus K and V of ``mean_context`` tokens per sequence."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    numel = safetensors_numel(folder)
    if not cfg.get("tie_word_embeddings", False):
        numel.pop("model.embed_tokens.weight", None)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    return sum(numel.values()) * dtype_bytes + kv_per_token * mean_context * batch


def floor_step_s(w: Workload, dtype: str, bandwidth_gb_s: float) -> float:
    dtype_bytes = 4 if dtype in ("float32", "float") else 2
    mean_context = w.input_len + w.output_len / 2  # decode steps run at contexts input_len .. +output_len
    return decode_step_bytes(model_folder(w.model), dtype_bytes, w.num_prompts, mean_context) / (
        bandwidth_gb_s * 1e9
    )


# ---- the table ----


@dataclass(frozen=True)
class Row:
    workload: str
    metric: str
    values: dict[str, float]  # engine -> the row's metric
    runs: dict[str, list[float]]  # engine -> the measurements behind it (s)
    floor: str = ""


def describe(w: Workload) -> str:
    shape = f"{w.input_len} -> 1 (start-up)" if w.kind == "startup" else f"{w.input_len} -> {w.output_len}"
    return f"({w.name}) {w.model}, {w.num_prompts} x {shape}"


def workload_rows(w: Workload, runs: dict[str, EngineRun], floor_s: float | None) -> list[Row]:
    ok = {e: r for e, r in runs.items() if r.error is None}
    if w.kind == "throughput":
        tok_s = {
            e: ThroughputResult(
                w.model, e, w.num_prompts, w.input_len, w.output_len, r.load_s or 0, r.run_s
            ).output_tok_s
            for e, r in ok.items()
        }
        floor = ""
        if floor_s is not None:
            # Measured mean step = batch / output tok/s (prefill included, as in the wall clock).
            reached = ", ".join(f"{e} {floor_s / (w.num_prompts / v):.0%}" for e, v in tok_s.items())
            floor = f"{floor_s * 1e3:.2f} ms/step: {reached}"
        return [Row(describe(w), "output tok/s (higher is better)", tok_s, _runs(ok), floor)]
    if w.kind == "latency":
        ttft = {e: statistics.median(r.ttft_s) for e, r in ok.items()}
        tpot = {e: (statistics.median(r.run_s) - ttft[e]) / (w.output_len - 1) for e, r in ok.items()}
        return [
            Row(describe(w), "TPOT ms (lower is better)", _ms(tpot), _runs(ok)),
            Row(describe(w), "TTFT ms, 1-token run (lower is better)", _ms(ttft), _runs(ok, "ttft_s")),
        ]
    # startup: axon ran cold then warm; vLLM ran once and stands beside both.
    rows = []
    for i, cache in enumerate(("cold", "warm")):
        values = {e: r.run_s[min(i, len(r.run_s) - 1)] for e, r in ok.items()}
        runs_i = {e: [v] for e, v in values.items()}
        rows.append(Row(describe(w), f"start s, axon {cache} cache (lower is better)", values, runs_i))
    return rows


def _ms(values: dict[str, float]) -> dict[str, float]:
    return {e: v * 1e3 for e, v in values.items()}


def _runs(runs: dict[str, EngineRun], key: str = "run_s") -> dict[str, list[float]]:
    return {e: getattr(r, key) for e, r in runs.items()}


TABLE_HEADER = [
    "workload",
    "metric",
    *ENGINE_NAMES,
    *(f"axon/{e}" for e in ENGINE_NAMES[1:]),
    "bandwidth floor: step, share reached",
    "timed runs s",
]


def table(rows: list[Row]) -> str:
    def cell(v: float | None) -> str:
        return "" if v is None else f"{v:,.1f}" if v >= 10 else f"{v:.2f}"

    def ratio(row: Row, base: str) -> str:
        a, b = row.values.get("axon"), row.values.get(base)
        return f"{a / b:.2f}x" if a is not None and b else ""

    out = []
    for r in rows:
        runs = "; ".join(f"{e} " + "/".join(f"{t:.2f}" for t in ts) for e, ts in r.runs.items())
        engines = [cell(r.values.get(e)) for e in ENGINE_NAMES]
        out.append([r.workload, r.metric, *engines, *(ratio(r, e) for e in ENGINE_NAMES[1:]), r.floor, runs])
    return markdown_table(TABLE_HEADER, out)


# ---- command line ----


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="a,b,c,d,e", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument(
        "--engines", default=",".join(ENGINE_NAMES), help=f"comma list of {', '.join(ENGINE_NAMES)}"
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--axon-args",
        default="{}",
        help="extra LLM(...) options for axon, as JSON: '{\"enforce_eager\": true}'",
    )
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument(
        "--openvino-python",
        default="/tmp/ov-venv/bin/python",
        help="Python of a venv with openvino-genai and optimum-intel[openvino] (benchmarks/README.md)",
    )
    p.add_argument(
        "--openvino-weights",
        default="auto",
        choices=["auto", "int8"],
        help="auto: an fp16 (fp32 for --dtype float32) export run at --dtype, KV cache included; int8: "
        "optimum's int8 export with its own defaults (a u8 KV cache, activations in groups of 32)",
    )
    for flag in ("--num-prompts", "--input-len", "--output-len"):
        p.add_argument(
            flag, type=int, default=None, help="override every chosen workload's (for quick tries)"
        )
    p.add_argument(
        "--log-dir", default=None, help="per-worker logs and specs (default: a new temporary folder)"
    )
    p.add_argument("--worker-timeout", type=float, default=1800, help="seconds before a worker is killed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every measurement here")
    args = p.parse_args(argv)
    args.workloads = _names(p, "--workloads", args.workloads, WORKLOADS)
    args.engines = _names(p, "--engines", args.engines, ENGINE_NAMES)
    for flag in ("runs", "num_prompts", "input_len", "output_len"):
        value = getattr(args, flag)
        if value is not None and value < (2 if flag == "output_len" else 1):
            p.error(
                f"--{flag.replace('_', '-')} must be at least {2 if flag == 'output_len' else 1}, got {value}"
            )
    args.axon_args = _axon_args(p, args.axon_args)
    if "vllm" in args.engines and not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python!r} is not an executable; see benchmarks/README.md")
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="vs_peers-")
    os.makedirs(args.log_dir, exist_ok=True)
    return args


def _names(p: argparse.ArgumentParser, flag: str, value: str, known: Sequence[str]) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"{flag}: unknown {unknown or value!r}; supported: {', '.join(known)}")
    return names


def _axon_args(p: argparse.ArgumentParser, text: str) -> dict[str, Any]:
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        p.error(f"--axon-args must be a JSON object, got {text!r}: {e}")
    if not isinstance(extra, dict):
        p.error(f"--axon-args must be a JSON object, got {text!r}")
    from axon.config import build_config  # names checked here, not after twenty minutes

    try:
        build_config(**extra)
    except (ValueError, TypeError) as e:
        p.error(f"--axon-args: {e}")
    return extra


def chosen_workloads(args: argparse.Namespace) -> list[Workload]:
    overrides = {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len")}
    out = []
    for name in args.workloads:
        w = WORKLOADS[name]
        fixed = {k: v for k, v in overrides.items() if v is not None}
        if w.kind == "latency":
            fixed.pop("num_prompts", None)  # one request alone, always
        if w.kind == "startup":
            fixed = {k: v for k, v in fixed.items() if k == "input_len"}
        out.append(dataclasses.replace(w, **fixed))
    return out


def bench_workload(w: Workload, args: argparse.Namespace) -> dict[str, EngineRun]:
    runs = {}
    for engine in (e for e in args.engines if e in w.engines):
        start = time.perf_counter()
        runner = run_startup if w.kind == "startup" else run_worker
        try:
            runs[engine] = runner(w, engine, args)
        except subprocess.TimeoutExpired as e:
            runs[engine] = EngineRun(w.name, engine, error=f"timed out after {e.timeout:.0f} s")
        r = runs[engine]
        status = r.error or f"runs {'/'.join(f'{t:.2f}' for t in r.run_s)} s"
        note = f"; {r.note}" if r.note else ""
        print(f"[{w.name}/{engine}] {status} ({time.perf_counter() - start:.0f} s){note}", flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
        return
    args = parse_args(argv)
    workloads = chosen_workloads(args)
    bandwidth = None
    if any(w.kind == "throughput" for w in workloads):
        bandwidth = read_bandwidth_gb_s()
    vllm_env = {k: v for k, v in vllm_cpu_env(args.vllm_python).items() if k.startswith(("VLLM_", "LD_"))}
    print(
        f"{args.dtype}, greedy, EOS ignored, prompts of random ids (seed {PROMPT_SEED}); median of "
        f"{args.runs} runs after one warm-up; axon args {args.axon_args}; vLLM env {vllm_env}; "
        f"read bandwidth {bandwidth or 0:.1f} GB/s (1 GiB bf16 sum, median of 5); logs in {args.log_dir}",
        flush=True,
    )
    rows: list[Row] = []
    record: dict[str, Any] = {"args": vars(args), "bandwidth_gb_s": bandwidth, "runs": [], "rows": []}
    for w in workloads:
        runs = bench_workload(w, args)
        floor = floor_step_s(w, args.dtype, bandwidth) if w.kind == "throughput" and bandwidth else None
        rows += workload_rows(w, runs, floor)
        record["runs"] += [
            {**dataclasses.asdict(r), "workload_spec": dataclasses.asdict(w)} for r in runs.values()
        ]
        record["rows"] = [dataclasses.asdict(r) for r in rows]
        if args.json:  # after every workload, so an interrupted run keeps what it measured
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
    print()
    print(table(rows))
    for r in record["runs"]:
        if r["error"]:
            print(f"FAILED {r['workload']}/{r['engine']}: {r['error']}")


if __name__ == "__main__":
    main()
