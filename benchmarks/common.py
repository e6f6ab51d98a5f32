"""Shared pieces of axon's benchmarks: model folders, fixed workloads, timing and tables."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

TINY_LLAMA_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
# A small Qwen3-MoE: 12 sparse layers of 16 experts, 4 per token (the MoE workload's model).
QWEN3_MOE_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "moe_intermediate_size": 512,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
}
# A GPT-OSS of the same size: 12 layers alternating sliding (128) and full attention, sinks, YaRN.
GPT_OSS_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 512,
    "num_local_experts": 16,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "sliding_window": 128,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
}
TINY_LLAMA_SEED = 0


def bench_cache_root() -> str:
    return os.path.join(os.path.expanduser("~/.cache/axon"), "bench")


def smollm2_folder() -> str:
    """The bundled SmolLM2-135M-Instruct as an HF folder (converted from its GGUF on first use)."""
    from axon.engine.arg_utils import create_engine_config

    path = create_engine_config(model=None).model_config.model_path
    assert path is not None, "resolve_config() sets model_path"
    return path


def tiny_llama_folder() -> str:
    """A seeded random-weight Llama saved once (safetensors, bf16) with SmolLM2's tokenizer."""
    folder = os.path.join(bench_cache_root(), "tiny-llama")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        _build_tiny_llama(folder)
    return folder


def _build_tiny_llama(folder: str) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        **TINY_LLAMA_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False
    )
    _build_random(config, folder)


def qwen3_moe_folder() -> str:
    """A seeded random-weight Qwen3-MoE shaped like a small real one (QWEN3_MOE_SHAPE), saved
    once (safetensors, bf16) with SmolLM2's tokenizer."""
    folder = os.path.join(bench_cache_root(), "qwen3-moe")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(**QWEN3_MOE_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        _build_random(config, folder)
    return folder


def gpt_oss_folder() -> str:
    """A seeded random-weight GPT-OSS (GPT_OSS_SHAPE), bf16, SmolLM2's tokenizer, saved once."""
    folder = os.path.join(bench_cache_root(), "gpt-oss")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        from transformers import GptOssConfig

        config = GptOssConfig(**GPT_OSS_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        _build_random(config, folder)
    return folder


def _build_random(config: Any, folder: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    torch.manual_seed(TINY_LLAMA_SEED)
    model = AutoModelForCausalLM.from_config(config).bfloat16()
    # Write to a temporary folder and rename, so an interrupted build never looks finished.
    tmp = f"{folder}.tmp-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    os.replace(tmp, folder)


# Qwen3-VL-2B-Instruct's shape (its vocabulary aside: SmolLM2's tokenizer and Qwen's three vision
# tokens, 49,155 ids instead of 151,936).
QWEN3_VL_2B_TEXT = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                        "mrope_interleaved": True},
}  # fmt: skip
QWEN3_VL_2B_VISION = {
    "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2048,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
}  # fmt: skip
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def qwen3_vl_folder() -> str:
    """A seeded random-weight Qwen3-VL shaped like the 2B (QWEN3_VL_2B_*), bf16, saved once with
    SmolLM2's tokenizer plus Qwen's vision tokens and Qwen3-VL's image processor settings."""
    folder = os.path.join(bench_cache_root(), "qwen3-vl-2b-shape")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    import torch
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = QWEN3_VL_2B_TEXT | {"vocab_size": len(tokenizer), "bos_token_id": 1, "eos_token_id": 2}
    config = Qwen3VLConfig(
        text_config=text, vision_config=QWEN3_VL_2B_VISION, image_token_id=pad, vision_start_token_id=start,
        vision_end_token_id=end, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(TINY_LLAMA_SEED)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    model = model.to_empty(device="cpu").bfloat16()
    model.tie_weights()  # to_empty unties the LM head from the embedding
    with torch.no_grad():  # a fast random init (transformers' own takes minutes at this size)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    tmp = f"{folder}.tmp-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="20GB")
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "preprocessor_config.json"), "w") as f:
        json.dump({"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                   "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}, f)  # fmt: skip
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    os.replace(tmp, folder)
    return folder


MODEL_FOLDERS: dict[str, Callable[[], str]] = {
    "tiny": tiny_llama_folder,
    "smollm2": smollm2_folder,
    "qwen3_moe": qwen3_moe_folder,
    "gpt_oss": gpt_oss_folder,
    "qwen3_vl": qwen3_vl_folder,
}


def model_folder(name: str) -> str:
    if name not in MODEL_FOLDERS:
        raise ValueError(f"unknown model {name!r}; supported: {', '.join(MODEL_FOLDERS)}")
    return MODEL_FOLDERS[name]()


def vocab_size(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def random_prompts(num_prompts: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` lists of ``input_len`` token ids in [0, vocab), the same for a given seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num_prompts)]


def time_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class ThroughputResult:
    model: str
    engine: str
    num_prompts: int
    input_len: int
    output_len: int
    load_s: float
    run_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.run_s)

    @property
    def output_tok_s(self) -> float:
        return self.num_prompts * self.output_len / self.median_s

    @property
    def total_tok_s(self) -> float:
        return self.num_prompts * (self.input_len + self.output_len) / self.median_s

    def to_json(self) -> dict[str, object]:
        return {
            **asdict(self),
            "median_s": self.median_s,
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
        }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def vllm_cpu_env(vllm_python: str, kv_space_gib: float = 4, threads_bind: str = "0-1") -> dict[str, str]:
    """This process's environment plus the fastest vLLM-CPU setting measured here: KV space,
    OpenMP threads bound to cores, tcmalloc and the venv's bundled libiomp5 preloaded."""
    venv = os.path.dirname(os.path.dirname(vllm_python))
    preload = [p for p in (TCMALLOC, os.path.join(venv, "lib", "libiomp5.so")) if os.path.exists(p)]
    return dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=f"{kv_space_gib:g}",
        VLLM_CPU_OMP_THREADS_BIND=threads_bind,
        LD_PRELOAD=":".join(preload),
    )


def run_json_worker(
    cmd: Sequence[str], spec: dict[str, Any], stem: str, env: dict[str, str], cwd: str, timeout: float
) -> dict[str, Any] | str:
    """Run one benchmark worker: ``spec`` (with ``out`` set to ``{stem}.result.json``) goes to
    ``{stem}.spec.json``, whose path is appended to ``cmd``; output goes to ``{stem}.log``. Returns
    the worker's result, or an error naming the log."""
    spec["out"] = f"{stem}.result.json"
    with open(f"{stem}.spec.json", "w") as f:
        json.dump(spec, f)
    if os.path.exists(spec["out"]):  # a result left by an earlier run in the same folder
        os.remove(spec["out"])
    with open(f"{stem}.log", "w") as log:
        proc = subprocess.run(
            [*cmd, f"{stem}.spec.json"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
            timeout=timeout, check=False,
        )  # fmt: skip
    if proc.returncode != 0 or not os.path.exists(spec["out"]):
        return f"exit code {proc.returncode}; see {stem}.log"
    with open(spec["out"]) as f:
        return json.load(f)


def cpu_summary() -> str:
    """The CPU's model name, core count and the vector/matrix flags that decide kernel speed."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    shown = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags
    ]
    return f"{name}, {os.cpu_count()} cores, {' '.join(shown) or 'no AVX2/AVX-512/AMX'}"


# Servers: one process at a time on a free local port, answered /health 200 before any load.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(engine: str, folder: str, port: int, extra: Sequence[str], vllm_python: str) -> list[str]:
    """``axon serve`` from this Python, or vLLM's OpenAI server from its venv (its ``vllm``
    console script cannot find its own metadata), on 127.0.0.1:port with ``extra`` flags."""
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if engine == "axon":
        return [sys.executable, "-m", "axon.entrypoints.cli", "serve", folder, *where, *extra]
    assert engine == "vllm", f"unknown engine {engine!r}"
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, *where, *extra]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before /health answered 200")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"/health did not answer 200 within {timeout:.0f} s")


@dataclass(frozen=True)
class RunningServer:
    port: int  # on 127.0.0.1
    proc: subprocess.Popen
    startup_s: float  # process start -> /health 200
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def running_server(
    command: Callable[[int], list[str]], env: dict[str, str], log_path: str, startup_timeout: float
) -> Iterator[RunningServer]:
    """Start ``command(port)`` on a free port (output to ``log_path``), wait for /health 200,
    and stop it with SIGTERM (SIGKILL after 30 s) however the block ends."""
    port = free_port()
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(command(port), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, startup_timeout)
        yield RunningServer(port, proc, time.perf_counter() - start, log_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
