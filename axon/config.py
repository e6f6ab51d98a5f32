"""The frozen, typed config tree, built once at the edge.

Every option keeps vLLM's name and lives in exactly one sub-config; ``build_config(**kwargs)``
routes flat vLLM-style keyword arguments (or parsed CLI flags) to their sub-config, rejects
unknown names with a suggestion, and ``resolve_config`` turns the "auto" values into concrete
ones in one step that returns a new tree. Nothing here reads the environment at import time.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """HF folder or .gguf file; None: the bundled SmolLM2-135M-Instruct."""
    tokenizer: str | None = None
    """Tokenizer folder; None: the model's own."""
    served_model_name: str | None = None
    """The name the API answers to; None: the model argument."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: bfloat16 on CUDA and on CPUs with native
    bfloat16 (AVX-512 BF16, AMX), else float32."""
    max_model_len: int | None = None
    """Context length (prompt plus output) in tokens; None: the model's."""
    seed: int = 0
    """Seed for dummy weights and for requests that give none."""
    load_format: str = "auto"
    """auto | safetensors | gguf | dummy (random weights, for tests)."""
    max_logprobs: int = 20
    """The most logprobs / top_logprobs a request may ask for."""
    cache_root: str | None = None
    """Where converted GGUF folders, kernels and compiled graphs are kept; None:
    $AXON_CACHE_ROOT or ~/.cache/axon."""
    runner: str = "auto"
    """auto | generate | pooling. auto: pooling for encoder (embedding) architectures."""
    pooler_config: dict[str, Any] | None = None
    """Pooling models only, JSON: {"pooling_type": "LAST"|"MEAN"|"CLS"|"MAX", "normalize": bool,
    "instruction": str}; see axon/model/pooler.py, which checks it."""
    quantization: str | None = None
    """How linear weights are stored (vLLM's flag): int8 | int4 | fp8 | w8a8 | gguf; None: as
    loaded. int8: signed 8-bit codes, one scale per output channel (W8A16); int4: codes 0..15
    with a scale and a minimum per group of inputs (W4A16); fp8: FP8 E4M3 codes, one scale per
    output channel; w8a8: int8 weights per output channel times activations quantized to int8
    per token at each step, multiplied in int32 (AMX-INT8 / AVX-512 VNNI); all computed at load. gguf: a GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K,
    Q5_K, Q6_K), kept quantized. Every linear layer but the LM head (as vLLM); gguf: the file's
    layers, the LM head included."""
    quantization_group_size: int | None = None
    """int8 and int4: inputs per scale, a multiple of 16 that divides every layer's inputs; None:
    int4 128 (or the largest power of two under it that divides a layer's inputs), int8 one
    scale per output channel."""
    allowed_local_media_path: str | None = None
    """Multimodal models: the folder whose files file:// image URLs may read (vLLM's flag);
    None: no local files."""
    limit_mm_per_prompt: dict[str, Any] | None = None
    """Multimodal models, JSON: the most items of each modality one prompt may hold, {"image": N};
    None: 8 images."""
    enable_sleep_mode: bool = False
    """Allow sleep and wake_up (vLLM's flag; the server's POST /sleep, /wake_up, GET
    /is_sleeping): sleeping releases the KV cache's memory, waking allocates it again."""
    enable_prompt_embeds: bool = False
    """Accept prompts given as embeddings (vLLM's flag): offline {"prompt_embeds": tensor
    [num_tokens, hidden]}, on the server a completion's prompt_embeds (base64 of torch.save).
    They replace the embedding layer's output for the prompt; decoder models only."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer (vLLM's flag), for model folders without one: prompts are token ids
    ({"prompt_token_ids": [...]}, or a completion's list of ids) and outputs carry token ids
    and no text; text prompts, chats, stop strings and grammars are refused."""
    mm_encoder_only: bool = False
    """Multimodal models: an encoder server of encoder disaggregation (vLLM's flag). It loads only
    the vision tower and answers each request once its images' features are stored for the
    prefill/decode servers (ec_transfer_config, role ec_producer); it keeps no KV cache and
    generates nothing."""
    # Resolved by resolve_config(), never set by users:
    gguf_file: str | None = None  # the GGUF file the model came from, if it did
    model_path: str | None = None  # the HF folder actually loaded (a GGUF file is converted once)
    hf_config: dict[str, Any] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block (a power of two)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of shared prompt prefixes."""
    num_gpu_blocks_override: int | None = None
    """Exactly this many KV blocks, whatever the memory."""
    kv_cache_space_gib: float | None = None
    """CPU KV-cache budget in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); None: what max_num_seqs
    sequences of max_model_len need, at most 4 GiB and a quarter of the machine's memory."""
    gpu_memory_utilization: float = 0.9
    """CUDA only: the share of the GPU's memory for weights and KV cache."""
    kv_cache_dtype: str = "auto"
    """auto (the model's dtype) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2: K and V stored in one
    byte each with a per-layer scale (twice the blocks for the same memory); needs the cpu_flash
    attention backend (the CPU default)."""
    calculate_kv_scales: bool = False
    """FP8 KV cache: each layer's scales from the first step's keys and values (amax / 200 for
    K, amax / 100 for V, as vLLM), instead of 1.0."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every layer's KV in one group of blocks, even for a model with sliding-window layers
    (GPT-OSS), whose blocks out of the window are otherwise freed (vLLM's flag)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """The most sequences running at once."""
    max_num_batched_tokens: int | None = None
    """The most tokens in one step; None: 2048 (or max_model_len, if smaller)."""
    max_num_encoder_input_tokens: int | None = None
    """Multimodal models: the most image tokens one step's vision-tower call encodes (the images
    of the requests it admits; vLLM's encoder budget); a request whose images would pass it
    waits for the next step, one whose images alone exceed it runs them in a step of its own.
    None: max_num_batched_tokens."""
    scheduling_policy: str = "fcfs"
    """fcfs only, for now."""
    admission_kv_limit: bool = True
    """Holdback admission: admit only while the running set fits at its worst case, each request
    at its own longest (prompt + max_tokens + draft slots, at most max_model_len), so that
    decodes never preempt each other. Off: vLLM's optimistic admission (preemption may occur)."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs (each running request is scheduled ahead with a
    placeholder for the token step N is sampling). None: on where it helps: CUDA yes, the CPU
    no (axon/engine/core.py); structured-output steps run in sync."""


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks each layer is split across (axon/distributed/): one worker process per rank."""
    pipeline_parallel_size: int = 1
    """1 only (vLLM's neuron plugin has no pipeline parallelism either)."""
    data_parallel_size: int = 1
    """Engine cores behind one API server, each with its own tensor-parallel group; requests go
    to the least loaded."""
    data_parallel_rank: int = 0
    """This engine core's global rank among data_parallel_size (set per core by axon serve)."""
    data_parallel_size_local: int | None = None
    """Engine cores on this host; the other data_parallel_size minus these run on other hosts
    (axon serve --headless) and join the head at data_parallel_address. None: all of them. A
    --headless host must give it."""
    data_parallel_start_rank: int = 0
    """The global rank of this host's first engine core: a --headless host runs ranks
    start..start+data_parallel_size_local-1; the head's own are 0..data_parallel_size_local-1."""
    data_parallel_address: str = "127.0.0.1"
    """The head's IP address: it listens there for the engine cores of other hosts (and binds
    their sockets there); a --headless host connects to it."""
    data_parallel_rpc_port: int = 29550
    """The head's TCP port on data_parallel_address where other hosts' engine cores join it
    (vLLM's default)."""
    decode_context_parallel_size: int = 1
    """Shard each sequence's KV cache by position across this many ranks of the tensor-parallel
    group that hold the same KV heads (vLLM's DCP): each rank keeps 1/N of every sequence, so
    the cache holds N times the context, and attention merges the ranks' partial results by
    log-sum-exp. It divides tensor_parallel_size, and each KV head must be replicated on N ranks
    (tensor_parallel_size a multiple of num_key_value_heads x N)."""
    attention_dp_size: int = 1
    """Attention data parallelism (vllm-neuron's attention_dp_size; also read from
    additional_config.neuron_config): 1, or tensor_parallel_size to replicate attention on every
    rank and give each rank whole requests (their KV, all heads, only on that rank), while the
    MLP, the embedding and the LM head stay tensor-parallel. The query heads need not divide
    across the ranks. CPU only; steps run eagerly."""
    enable_expert_parallel: bool = False
    """MoE models: each of the tensor_parallel_size ranks holds num_experts / N whole experts
    (expert parallelism) instead of 1/N of every expert's width; attention splits as usual."""
    distributed_executor_backend: str | None = None
    """How the workers run (axon/executor/abstract.py): uni (one worker in the engine-core
    process), mp (one process per rank on this host), ray (one Ray actor per rank). None: uni
    for tensor_parallel_size 1, else mp."""


EXECUTOR_BACKENDS = ("uni", "mp", "ray")  # see axon/executor/abstract.py
BUCKET_COMPILE_POLICIES = ("on_demand", "warmup")  # see axon/worker/compiler.py
LINEAR_BACKENDS = ("auto", "cpu_bf16", "onednn", "torch")  # see axon/model/layers/linear.py
QUANTIZATION_METHODS = ("int8", "int4", "fp8", "w8a8", "gguf")  # see axon/model/layers/quant.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class CompilationConfig:
    enforce_eager: bool | None = None
    """No compiled graphs, every step eager. None: $AXON_ENFORCE_EAGER (1/0), else off, except
    for encoder-only models (BERT), which run eagerly at each step's exact size unless this is
    False."""
    num_batched_tokens_buckets: tuple[int, ...] | None = None
    """Buckets of steps that prefill (static shapes; axon/worker/buckets.py), e.g. 128,512,2048;
    None: powers of two from 128 to max_num_batched_tokens. Also read from vllm-neuron's
    additional_config.neuron_config."""
    num_seqs_buckets: tuple[int, ...] | None = None
    """Buckets of decode-only steps (requests per step), e.g. 1,8,32; None: powers of two from 1
    to max_num_seqs."""
    decode_context_length_buckets: tuple[int, ...] | None = None
    """Context lengths a decode step's block table is padded to (multiples of block_size, below
    max_model_len); None: no padding."""
    bucket_compile: str = "on_demand"
    """on_demand: a bucket runs eagerly until the idle engine compiles the buckets traffic
    reached; warmup: compile every bucket before serving."""
    attention_backend: str = "auto"
    """auto | reference | cpu_paged | cpu_flash. auto: cpu_flash on the CPU (cpu_paged without
    a C++ compiler), reference elsewhere."""
    linear_backend: str = "auto"
    """auto | cpu_bf16 | onednn | torch. auto: axon's bf16 kernel on AVX-512 BF16 CPUs, else
    oneDNN with prepacked weights on the CPU (axon/model/layers/linear.py), else torch."""
    inductor_compile_config: dict[str, Any] | None = None
    """Inductor options for the bucket graphs, JSON (vLLM's compilation_config key), over axon's
    defaults {"size_asserts": false, "cpp_wrapper": true} (CPU): no check of every input's size and
    strides at each call (546 checks a SmolLM2 step), and the step's kernels called from C++,
    not Python: a decode step 9% faster, each bucket's first compile about 13 s longer (README,
    "Execution: buckets, compiled graphs")."""
    compile_cache_store: str | None = None
    """A folder every host can read and write (NFS, a mounted bucket): compiled graphs are
    fetched from it before compiling and published to it after, so a second host or a restarted
    pod starts warm (axon/worker/compiler.py). None: $AXON_COMPILE_CACHE_STORE, else none."""


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) beside the base model, several in one step (vLLM's flag)."""
    max_loras: int = 1
    """Adapters one step may hold (each has a slot in every adapted layer)."""
    max_lora_rank: int = 16
    """The largest adapter rank accepted (the slots' width)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory for a slot to take without reading the folder again;
    None: max_loras."""


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding, JSON (vLLM's keys): {"method": "ngram"|"draft_model"|"eagle3",
    "num_speculative_tokens": k, "model": PATH, "prompt_lookup_min": m, "prompt_lookup_max": M,
    "disable_by_batch_size": n, "adaptive": true}; see axon/spec_decode/config.py, which checks it."""


@dataclass(frozen=True)
class StructuredOutputsConfig:
    structured_outputs_config: dict[str, Any] | None = None
    """JSON: {"backend": "auto"|"xgrammar", "disable_any_whitespace": bool, ...}; see
    axon/structured_output/options.py, which checks it."""
    reasoning_parser: str | None = None
    """Thinking models (qwen3, deepseek_r1): <think>...</think> goes to reasoning_content;
    grammars apply after it."""


@dataclass(frozen=True)
class KVTransferConfig:
    kv_transfer_config: dict[str, Any] | None = None
    """Disaggregated prefill/decode, JSON (vLLM's keys): {"kv_connector": "NixlConnector"|
    "SharedStorageConnector", "kv_role": "kv_producer"|"kv_consumer"|"kv_both",
    "kv_load_failure_policy": "recompute"|"fail", "kv_connector_extra_config": {...}}; see
    axon/kv_transfer/config.py, which checks it."""
    kv_events_config: dict[str, Any] | None = None
    """KV cache events for KV-aware routers, JSON (vLLM's keys): {"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ""}; see
    axon/kv_transfer/kv_events.py, which checks it."""

    ec_transfer_config: dict[str, Any] | None = None
    """Encoder disaggregation, JSON (vLLM's keys): {"ec_connector": "ECExampleConnector",
    "ec_role": "ec_producer"|"ec_consumer"|"ec_both", "ec_connector_extra_config":
    {"shared_storage_path": "/dev/shm/axon-ec", "ttl_seconds": 600}}: a producer stores the
    features of the images it encodes, a consumer loads them instead of encoding; see
    axon/kv_transfer/ec_connector.py."""


@dataclass(frozen=True)
class ObservabilityConfig:
    disable_log_stats: bool = False
    """Do not log throughput and KV usage every 10 s."""
    profiler_config: dict[str, Any] | None = None
    """JSON (vLLM's keys): {"profiler": "torch", "torch_profiler_dir": DIR, ...}: the server's
    POST /start_profile and /stop_profile write Chrome traces of every engine process into DIR
    (axon/debug/profiler.py); None: $VLLM_TORCH_PROFILER_DIR, else no profiling."""


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    """auto | cpu | cuda. auto: cuda when available."""
    num_threads: int | None = None
    """CPU intra-op threads; None: one per CPU of omp_threads_bind."""
    omp_threads_bind: str | None = None
    """CPUs the intra-op threads are pinned to, one each: auto (physical cores), all, nobind,
    or a list like 0-3,8. None: $VLLM_CPU_OMP_THREADS_BIND, else auto."""


@dataclass(frozen=True)
class AxonConfig:
    model_config: ModelConfig = ModelConfig()
    cache_config: CacheConfig = CacheConfig()
    scheduler_config: SchedulerConfig = SchedulerConfig()
    parallel_config: ParallelConfig = ParallelConfig()
    compilation_config: CompilationConfig = CompilationConfig()
    speculative_config: SpeculativeConfig = SpeculativeConfig()
    lora_config: LoRAConfig = LoRAConfig()
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    kv_transfer_config: KVTransferConfig = KVTransferConfig()
    observability_config: ObservabilityConfig = ObservabilityConfig()
    device_config: DeviceConfig = DeviceConfig()
    additional_config: dict[str, Any] = field(default_factory=dict)

    @property
    def scheduler_block_size(self) -> int:
        """Positions of a sequence one KV block id covers, as the scheduler counts them: block_size,
        times decode_context_parallel_size (each rank of a group holds block_size of them)."""
        return self.cache_config.block_size * self.parallel_config.decode_context_parallel_size


_RESOLVED_ONLY = {"model_path", "hf_config", "gguf_file"}
# Options that parse from JSON strings when given as text (CLI flags).
_JSON_OPTIONS = {
    "speculative_config",
    "structured_outputs_config",
    "kv_transfer_config",
    "kv_events_config",
    "ec_transfer_config",
    "profiler_config",
    "inductor_compile_config",
    "additional_config",
    "pooler_config",
    "limit_mm_per_prompt",
}


def _option_owners() -> dict[str, str]:
    """Flat option name -> name of the AxonConfig field (sub-config) that holds it."""
    owners: dict[str, str] = {}
    for sub in fields(AxonConfig):
        if sub.name == "additional_config":
            owners["additional_config"] = sub.name
            continue
        for f in fields(sub.default):  # type: ignore[arg-type]
            if f.name not in _RESOLVED_ONLY:
                assert f.name not in owners, f"option {f.name} defined twice"
                owners[f.name] = sub.name
    return owners


OPTION_OWNERS = _option_owners()


def option_fields() -> list[tuple[str, dataclasses.Field[Any]]]:
    """(sub-config name, field) for every user option, in declaration order (CLI generation)."""
    out = []
    for sub in fields(AxonConfig):
        if sub.name == "additional_config":
            continue
        out += [(sub.name, f) for f in fields(sub.default) if f.name not in _RESOLVED_ONLY]  # type: ignore[arg-type]
    return out


@functools.cache
def option_docs() -> dict[str, str]:
    """Option name -> its attribute docstring in this file (the string under the field), read
    once: the one place an option is documented, for ``--help`` and for readers of the code."""
    docs: dict[str, str] = {}
    for node in ast.walk(ast.parse(inspect.getsource(sys.modules[__name__]))):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, nxt in zip(node.body, node.body[1:], strict=False):
            is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_doc:
                docs[stmt.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs


def build_config(**kwargs: Any) -> AxonConfig:
    """Route flat vLLM-named options into the config tree. Unknown names are errors."""
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in kwargs.items():
        owner = OPTION_OWNERS.get(name)
        if owner is None:
            close = difflib.get_close_matches(name, OPTION_OWNERS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown option '{name}'{hint}")
        if name in _JSON_OPTIONS and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name} must be a JSON object, got {value!r}: {e}") from None
        grouped.setdefault(owner, {})[name] = value
    additional = grouped.pop("additional_config", {}).get("additional_config") or {}
    if not isinstance(additional, dict):
        raise ValueError(f"additional_config must be a JSON object, got {additional!r}")  # noqa: TRY004
    subs = {owner: type(getattr(AxonConfig(), owner))(**opts) for owner, opts in grouped.items()}
    config = AxonConfig(**subs, additional_config=additional)
    validate_config(config)
    return config


def validate_config(config: AxonConfig) -> None:
    """Checks that need no model: each error names the option and its value."""
    m, c, s, p = config.model_config, config.cache_config, config.scheduler_config, config.parallel_config

    def need(ok: bool, name: str, value: Any, why: str) -> None:
        if not ok:
            raise ValueError(f"{name} {why}, got {value!r}.")

    need(
        m.dtype in ("auto", "float32", "bfloat16", "float16", "half", "float"),
        "dtype",
        m.dtype,
        "must be one of auto, float32, bfloat16, float16",
    )
    need(
        m.load_format in ("auto", "safetensors", "gguf", "dummy"),
        "load_format",
        m.load_format,
        "must be one of auto, safetensors, gguf, dummy",
    )
    need(
        m.quantization in (None, *QUANTIZATION_METHODS),
        "quantization",
        m.quantization,
        f"must be one of {', '.join(QUANTIZATION_METHODS)} (or unset)",
    )
    need(
        m.quantization_group_size is None
        or (m.quantization_group_size >= 16 and m.quantization_group_size % 16 == 0),
        "quantization_group_size",
        m.quantization_group_size,
        "must be a positive multiple of 16",
    )
    need(
        m.quantization_group_size is None or m.quantization in ("int8", "int4"),
        "quantization_group_size",
        m.quantization_group_size,
        "applies only to quantization int8 or int4",
    )
    need(
        m.runner in ("auto", "generate", "pooling"),
        "runner",
        m.runner,
        "must be one of auto, generate, pooling",
    )
    need(
        m.max_model_len is None or m.max_model_len >= 1,
        "max_model_len",
        m.max_model_len,
        "must be at least 1",
    )
    need(
        c.block_size >= 1 and c.block_size & (c.block_size - 1) == 0,
        "block_size",
        c.block_size,
        "must be a positive power of two",
    )
    need(
        c.num_gpu_blocks_override is None or c.num_gpu_blocks_override >= 2,
        "num_gpu_blocks_override",
        c.num_gpu_blocks_override,
        "must be at least 2 (block 0 is reserved)",
    )
    need(
        c.kv_cache_space_gib is None or c.kv_cache_space_gib > 0,
        "kv_cache_space_gib",
        c.kv_cache_space_gib,
        "must be positive",
    )
    need(
        0.0 < c.gpu_memory_utilization <= 1.0,
        "gpu_memory_utilization",
        c.gpu_memory_utilization,
        "must be in (0, 1]",
    )
    need(
        c.kv_cache_dtype in KV_CACHE_DTYPES,
        "kv_cache_dtype",
        c.kv_cache_dtype,
        f"must be one of {', '.join(KV_CACHE_DTYPES)}",
    )
    need(
        not c.calculate_kv_scales or c.kv_cache_dtype != "auto",
        "calculate_kv_scales",
        c.calculate_kv_scales,
        "applies only to an FP8 KV cache (kv_cache_dtype fp8, fp8_e4m3 or fp8_e5m2)",
    )
    need(s.max_num_seqs >= 1, "max_num_seqs", s.max_num_seqs, "must be at least 1")
    need(
        s.max_num_batched_tokens is None or s.max_num_batched_tokens >= 1,
        "max_num_batched_tokens",
        s.max_num_batched_tokens,
        "must be at least 1",
    )
    need(
        s.max_num_encoder_input_tokens is None or s.max_num_encoder_input_tokens >= 1,
        "max_num_encoder_input_tokens",
        s.max_num_encoder_input_tokens,
        "must be at least 1",
    )
    lo = config.lora_config
    need(lo.max_loras >= 1, "max_loras", lo.max_loras, "must be at least 1")
    need(lo.max_lora_rank >= 1, "max_lora_rank", lo.max_lora_rank, "must be at least 1")
    need(
        lo.max_cpu_loras is None or lo.max_cpu_loras >= lo.max_loras,
        "max_cpu_loras",
        lo.max_cpu_loras,
        "must be at least max_loras",
    )
    need(s.scheduling_policy == "fcfs", "scheduling_policy", s.scheduling_policy, "supports only 'fcfs'")
    for name in (
        "tensor_parallel_size",
        "data_parallel_size",
        "decode_context_parallel_size",
        "attention_dp_size",
    ):
        value = getattr(p, name)
        need(isinstance(value, int) and value >= 1, name, value, "must be an integer of at least 1")
    need(p.pipeline_parallel_size == 1, "pipeline_parallel_size", p.pipeline_parallel_size, "must be 1")
    need(
        p.attention_dp_size in (1, p.tensor_parallel_size),
        "attention_dp_size",
        p.attention_dp_size,
        f"must be 1 or tensor_parallel_size ({p.tensor_parallel_size}): attention is replicated on every rank",
    )
    need(
        p.attention_dp_size == 1 or p.decode_context_parallel_size == 1,
        "attention_dp_size",
        p.attention_dp_size,
        "cannot be combined with decode_context_parallel_size (each shards the KV cache its own way)",
    )
    need(
        p.tensor_parallel_size % p.decode_context_parallel_size == 0,
        "decode_context_parallel_size",
        p.decode_context_parallel_size,
        f"must divide tensor_parallel_size ({p.tensor_parallel_size}): its ranks are tensor-parallel ranks",
    )
    _validate_data_parallel_hosts(p)
    need(
        0 <= p.data_parallel_rank < p.data_parallel_size,
        "data_parallel_rank",
        p.data_parallel_rank,
        f"must be in 0..{p.data_parallel_size - 1} (data_parallel_size {p.data_parallel_size})",
    )
    backend = p.distributed_executor_backend
    need(
        backend is None or backend in EXECUTOR_BACKENDS,
        "distributed_executor_backend",
        backend,
        f"is unknown; supported: {', '.join(EXECUTOR_BACKENDS)}",
    )
    need(
        not (backend == "uni" and p.tensor_parallel_size > 1),
        "distributed_executor_backend",
        backend,
        f"runs one worker; tensor_parallel_size {p.tensor_parallel_size} needs 'mp' or 'ray'",
    )
    need(
        config.device_config.device in ("auto", "cpu", "cuda"),
        "device",
        config.device_config.device,
        "must be one of auto, cpu, cuda",
    )
    need(m.max_logprobs >= 0, "max_logprobs", m.max_logprobs, "must be non-negative")
    comp = config.compilation_config
    need(
        comp.bucket_compile in BUCKET_COMPILE_POLICIES,
        "bucket_compile",
        comp.bucket_compile,
        f"must be one of {', '.join(BUCKET_COMPILE_POLICIES)}",
    )
    _validate_inductor_options(comp.inductor_compile_config)
    need(
        comp.linear_backend in LINEAR_BACKENDS,
        "linear_backend",
        comp.linear_backend,
        f"must be one of {', '.join(LINEAR_BACKENDS)}",
    )


# What axon changes in Inductor's defaults for the bucket graphs (inductor_compile_config):
# per-call work of the graph's own (input checks, a Python wrapper calling every kernel).
# On CUDA the step replays as a CUDA graph, so the wrapper's Python is not on its path.
DEFAULT_INDUCTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"size_asserts": False, "cpp_wrapper": True},
    "cuda": {"size_asserts": False},
}


def inductor_options(comp: CompilationConfig, device_type: str) -> dict[str, Any]:
    """The Inductor options the bucket graphs compile with: axon's defaults, then the user's."""
    return {**DEFAULT_INDUCTOR_OPTIONS.get(device_type, {}), **(comp.inductor_compile_config or {})}


def _validate_inductor_options(options: Any) -> None:
    if options is None:
        return
    if not isinstance(options, dict):
        raise ValueError(f"inductor_compile_config must be a JSON object, got {options!r}")  # noqa: TRY004
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"inductor_compile_config has an option Inductor does not know: {key!r}{hint}")


def _validate_data_parallel_hosts(p: ParallelConfig) -> None:
    """The split of data_parallel_size engine cores across hosts (axon serve --headless)."""
    size, local, start = p.data_parallel_size, p.data_parallel_size_local, p.data_parallel_start_rank
    if local is not None and not (isinstance(local, int) and 0 <= local <= size):
        raise ValueError(
            f"data_parallel_size_local must be in 0..{size} (data_parallel_size {size}), got {local!r}."
        )
    num_local = size if local is None else local
    if not (isinstance(start, int) and 0 <= start and start + num_local <= size):
        raise ValueError(
            f"data_parallel_start_rank must put this host's engine cores (data_parallel_size_local "
            f"{num_local}: ranks start..start+{num_local - 1}) within 0..{size - 1} "
            f"(data_parallel_size {size}), got {start!r}."
        )
    if not p.data_parallel_address.strip():
        raise ValueError("data_parallel_address must be the head's IP address, got ''.")
    if not 1 <= p.data_parallel_rpc_port <= 65535:
        raise ValueError(f"data_parallel_rpc_port must be in 1..65535, got {p.data_parallel_rpc_port!r}.")


def default_cache_root() -> str:
    return os.environ.get("AXON_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "axon")


def replace(obj: Any, **changes: Any) -> Any:
    return dataclasses.replace(obj, **changes)


def blocks_per_seq(
    max_model_len: int, block_size: int, window: int | None = None, max_num_batched_tokens: int = 0
) -> int:
    """The most blocks one request of ``max_model_len`` tokens holds: one per ``block_size``
    tokens, and with a sliding-window group (kv_cache_manager.py) those of the window and of one
    step's tokens (at most ``max_num_batched_tokens``) too."""
    full = -(-max_model_len // block_size)
    if window is None:
        return full
    return full + min(full, -(-(window + max_num_batched_tokens) // block_size) + 1)
