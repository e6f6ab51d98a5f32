"""From user options to a resolved AxonConfig: build (names checked), then resolve "auto"s."""

from __future__ import annotations

import os
from typing import Any

import torch

from axon.config import (
    AxonConfig,
    KVTransferConfig,
    StructuredOutputsConfig,
    build_config,
    default_cache_root,
    replace,
    validate_config,
)
from axon.kv_transfer.config import parse_kv_transfer_config
from axon.kv_transfer.ec_connector import parse_ec_transfer_config
from axon.kv_transfer.kv_events import parse_kv_events_config
from axon.metrics.profiler import parse_profiler_config
from axon.model.layers.tensor_parallel import check_share, check_split
from axon.model.loader import default_model_path, gguf_to_hf_folder, load_hf_config
from axon.model.loader.default_model import (
    DEFAULT_EMBEDDING_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    default_embedding_model_path,
)
from axon.model.pooler import model_pooler_config
from axon.model.registry import can_pool, is_encoder_only, is_pooling_model, resolve_model_class
from axon.reasoning import get_reasoning_parser
from axon.spec_decode.config import check_draft_model, parse_spec_decode_config
from axon.structured_output.options import parse_structured_outputs_config
from axon.worker.buckets import resolve_bucket_lists

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Embedding batches run whole (no decode steps to interleave). all-MiniLM-L6-v2, float32, on an
# idle 2-core Zen 4 (benchmarks/embeddings.py): 2,048 padded tokens a batch 200-202 emb/s,
# 1,024 202, 4,096 189, 16,384 155 (a batch's activations stay in cache); on a loaded 2-core
# AVX2 machine 16,384 had measured faster (fewer thread barriers). A longer prompt runs alone.
DEFAULT_POOLING_MAX_NUM_BATCHED_TOKENS = 2048


def create_engine_config(**kwargs: Any) -> AxonConfig:
    return resolve_config(build_config(**kwargs))


def resolve_config(config: AxonConfig) -> AxonConfig:
    """Locate and read the model, then fill every "auto"/None value. Returns a new tree."""
    _check_structured_outputs(config.structured_outputs_config)  # before any model work
    parse_profiler_config(config.observability_config.profiler_config)
    m = config.model_config
    cache_root = m.cache_root or default_cache_root()
    # No model with runner="pooling": the bundled embedding model, not the generative one.
    default_embedding = m.model is None and m.runner == "pooling"
    model = default_embedding_model_path() if default_embedding else m.model
    gguf_file = _gguf_file(model, m.load_format)
    model_path = _resolve_model_path(model, gguf_file, cache_root)
    hf = load_hf_config(model_path)
    _check_quantization(m.quantization, gguf_file, hf, model_path)
    # An unsupported architecture fails here, early.
    model_class = resolve_model_class(hf.get("architectures"))
    runner = _resolve_runner(m.runner, model_class, hf)
    _check_prompt_embeds(config, model_class, hf, runner)
    _check_lora(config, model_class, hf, runner)
    _check_encoder_disaggregation(config, model_class, hf)
    config = _resolve_attention_dp(config, runner)
    _check_tensor_parallel(config, model_class, hf)
    model_max = int(hf.get("max_position_embeddings") or 2048)
    default_len = model_max
    if runner == "pooling":
        # Checks pooler_config now; sentence-transformers' max_seq_length is the length the
        # embeddings were trained for.
        pooler = model_pooler_config(replace(m, model_path=model_path, hf_config=hf))
        default_len = min(model_max, pooler.max_seq_length or model_max)
    elif m.pooler_config is not None:
        raise ValueError("pooler_config applies only to embedding models (runner='pooling')")
    max_model_len = m.max_model_len or default_len
    if max_model_len > model_max:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's context length {model_max} "
            f"(max_position_embeddings in {model_path}/config.json)."
        )
    model_config = replace(
        m,
        model_path=model_path,
        hf_config=hf,
        max_model_len=max_model_len,
        runner=runner,
        cache_root=cache_root,
        tokenizer=m.tokenizer or model_path,
        served_model_name=m.served_model_name
        or m.model
        or (DEFAULT_EMBEDDING_MODEL_NAME if default_embedding else DEFAULT_MODEL_NAME),
        load_format="dummy" if m.load_format == "dummy" else "safetensors",
        gguf_file=gguf_file,
    )
    s = config.scheduler_config
    default_tokens = (
        DEFAULT_POOLING_MAX_NUM_BATCHED_TOKENS if runner == "pooling" else DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    scheduler_config = replace(s, max_num_batched_tokens=s.max_num_batched_tokens or default_tokens)
    c = config.cache_config
    env_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if c.kv_cache_space_gib is None and env_space and float(env_space) > 0:
        c = replace(c, kv_cache_space_gib=float(env_space))
    comp = config.compilation_config
    if comp.enforce_eager is None:
        env = os.environ.get("AXON_ENFORCE_EAGER")
        # An encoder (BERT) runs eagerly at each step's exact size unless compilation is asked
        # for: its steps are GEMMs (opaque packed ops either way), so padding to a bucket costs
        # more than the graph saves (all-MiniLM-L6-v2 one request at a time: 75 embeddings/s
        # eager against 47 compiled; 32 concurrent: 145 against 130).
        eager = env not in ("", "0") if env is not None else is_encoder_only(model_class)
        comp = replace(comp, enforce_eager=eager)
    resolved = replace(
        config,
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=c,
        compilation_config=comp,
        speculative_config=_resolve_speculative(config, runner, hf, cache_root),
        kv_transfer_config=_resolve_kv_transfer(config, runner),
    )
    # Bucket lists are resolved and checked here, once, before a model loads; the worker reads them.
    return replace(resolved, compilation_config=resolve_bucket_lists(resolved))


def _resolve_kv_transfer(config: AxonConfig, runner: str) -> KVTransferConfig:
    """The checked KV connector settings, with one engine id that every process of this server
    (the scheduler's and the worker's halves) shares."""
    kv = config.kv_transfer_config
    parse_kv_events_config(kv.kv_events_config)  # checked here: a bad one is a usage error
    settings = parse_kv_transfer_config(kv.kv_transfer_config)
    if settings is None:
        return kv
    if runner != "generate":
        raise ValueError("kv_transfer_config applies only to generative models (runner='generate')")
    tp = config.parallel_config.tensor_parallel_size
    if tp != 1:
        raise ValueError(
            f"kv_transfer_config with tensor_parallel_size {tp} is not supported yet: each server of a "
            "disaggregated pair runs tensor_parallel_size 1 (scale out with --data-parallel-size)"
        )
    if config.cache_config.calculate_kv_scales:
        raise ValueError(
            "kv_transfer_config cannot be combined with calculate_kv_scales: the FP8 scales each server "
            "calculates would differ from the ones the transferred blocks were written with"
        )
    raw = dict(kv.kv_transfer_config or {})
    raw.setdefault("engine_id", settings.engine_id)
    return replace(kv, kv_transfer_config=raw)


def _check_lora(config: AxonConfig, model_class: type, hf: dict[str, Any], runner: str) -> None:
    if not config.lora_config.enable_lora:
        return
    from axon.model.models.llama import LlamaForCausalLM

    why = None
    if runner != "generate" or not issubclass(model_class, LlamaForCausalLM) or "vision_config" in hf:
        why = f"{model_class.__name__} is not a decoder language model axon adapts"
    elif hf.get("num_experts") or hf.get("num_local_experts"):
        why = "a mixture-of-experts model's experts are not adapted yet"
    elif config.parallel_config.tensor_parallel_size != 1:
        why = "the adapters are not split across tensor-parallel ranks yet (tensor_parallel_size must be 1)"
    elif config.speculative_config.speculative_config is not None:
        why = "a draft would propose without the request's adapter"
    if why is not None:
        raise ValueError(f"enable_lora is not supported here: {why}")


def _check_prompt_embeds(config: AxonConfig, model_class: type, hf: dict[str, Any], runner: str) -> None:
    if not config.model_config.enable_prompt_embeds:
        return
    from axon.model.models.llama import LlamaForCausalLM

    why = None
    if runner != "generate" or not issubclass(model_class, LlamaForCausalLM):
        why = f"{model_class.__name__} does not take them (decoder language models do)"
    elif "vision_config" in hf:
        why = "a multimodal model's prompts carry images instead"
    elif config.speculative_config.speculative_config is not None:
        why = "speculative decoding drafts from token ids, which such a prompt does not have"
    if why is not None:
        raise ValueError(f"enable_prompt_embeds is not supported here: {why}")


def _check_encoder_disaggregation(config: AxonConfig, model_class: type, hf: dict[str, Any]) -> None:
    """--mm-encoder-only and --ec-transfer-config: a model with a vision tower, and an encoder
    server that hands its features on."""
    settings = parse_ec_transfer_config(config.kv_transfer_config.ec_transfer_config)
    encoder_only = config.model_config.mm_encoder_only
    if settings is None and not encoder_only:
        return
    flag = "--mm-encoder-only" if encoder_only else "--ec-transfer-config"
    if "vision_config" not in hf:
        raise ValueError(f"{flag} is for multimodal models: {model_class.__name__} has no vision encoder")
    if encoder_only and (settings is None or not settings.is_producer):
        raise ValueError(
            "--mm-encoder-only computes image features for other servers: give --ec-transfer-config with "
            '"ec_role": "ec_producer" (or "ec_both")'
        )
    if encoder_only and config.parallel_config.tensor_parallel_size != 1:
        raise ValueError(
            "--mm-encoder-only runs the vision tower on one rank: tensor_parallel_size must be 1"
        )


def _check_tensor_parallel(config: AxonConfig, model_class: type, hf: dict[str, Any]) -> None:
    """Before any rank loads: the model splits across tensor_parallel_size ranks, and what runs
    beside it can be split too."""
    tp = config.parallel_config.tensor_parallel_size
    if tp == 1:
        return
    if not getattr(model_class, "supports_tensor_parallel", False):
        raise ValueError(
            f"{model_class.__name__} cannot be split across ranks yet: tensor_parallel_size must be 1"
        )
    arch = model_class.arch_from_hf(hf)
    dense = len(arch.sparse_layers) < arch.num_layers
    if config.parallel_config.attention_dp_size > 1:  # whole attention on every rank
        if dense:
            check_share(arch.intermediate_size, tp, "intermediate_size")
    else:
        check_split(arch.num_heads, arch.num_kv_heads, arch.intermediate_size if dense else None, tp)
    if arch.num_experts:
        if config.parallel_config.enable_expert_parallel:
            check_share(arch.num_experts, tp, "number of experts (enable_expert_parallel)")
        else:
            check_share(arch.moe_intermediate_size, tp, "moe_intermediate_size")
    spec = parse_spec_decode_config(config.speculative_config.speculative_config)
    if spec is not None and spec.method != "ngram":
        raise ValueError(
            f"speculative_config.method {spec.method!r} is not supported with tensor_parallel_size {tp} "
            "yet (its draft runs unsharded); use 'ngram', or tensor_parallel_size 1"
        )
    _check_decode_context_parallel(config, arch.num_kv_heads)
    if config.model_config.quantization == "gguf":
        raise ValueError(
            f"quantization 'gguf' keeps the file's blocks whole and cannot split them across {tp} ranks; "
            "leave quantization unset (the GGUF weights load dequantized, each rank its slice) or use "
            "tensor_parallel_size 1"
        )


def _resolve_attention_dp(config: AxonConfig, runner: str) -> AxonConfig:
    """attention_dp_size from the flag or vllm-neuron's additional_config.neuron_config, checked;
    its steps run eagerly (each rank's share of a step's rows changes from step to step)."""
    p = config.parallel_config
    neuron = (config.additional_config or {}).get("neuron_config") or {}
    size = p.attention_dp_size
    if size == 1 and isinstance(neuron, dict) and neuron.get("attention_dp_size", 1) != 1:
        size = neuron["attention_dp_size"]
        config = replace(config, parallel_config=replace(p, attention_dp_size=size))
        validate_config(config)
    if size == 1 or p.tensor_parallel_size == 1:
        return config
    device = config.device_config.device
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        raise ValueError(
            "attention_dp_size needs the CPU: each rank's KV cache becomes resident only as its own "
            "requests write it, which a CUDA allocation does not"
        )
    if runner != "generate":
        raise ValueError("attention_dp_size applies only to generative models (runner='generate')")
    comp = config.compilation_config
    if comp.enforce_eager is False:
        raise ValueError(
            "attention_dp_size runs its steps eagerly (each rank's share of a step changes from step to "
            "step); drop enforce_eager=False"
        )
    return replace(config, compilation_config=replace(comp, enforce_eager=True))


def _check_decode_context_parallel(config: AxonConfig, num_kv_heads: int) -> None:
    """decode_context_parallel_size N shards the KV of each KV head across N ranks that all hold
    it: each KV head must be replicated on a multiple of N ranks."""
    p = config.parallel_config
    dcp, tp = p.decode_context_parallel_size, p.tensor_parallel_size
    if dcp == 1:
        return
    replicas = tp // num_kv_heads if num_kv_heads < tp else 1
    if replicas % dcp:
        raise ValueError(
            f"decode_context_parallel_size {dcp} needs each KV head on a multiple of {dcp} ranks, but "
            f"tensor_parallel_size {tp} puts each of the model's {num_kv_heads} KV heads on {replicas}: use a "
            f"tensor_parallel_size that is a multiple of {num_kv_heads * dcp}"
        )
    if config.cache_config.kv_cache_dtype != "auto":
        raise ValueError(
            f"decode_context_parallel_size {dcp} does not support kv_cache_dtype "
            f"{config.cache_config.kv_cache_dtype!r} yet; use 'auto'"
        )


def _resolve_speculative(config: AxonConfig, runner: str, hf: dict[str, Any], cache_root: str):
    """The checked speculative options (a GGUF draft converted once), before any model loads."""
    spec = parse_spec_decode_config(config.speculative_config.speculative_config)
    if spec is None:
        return config.speculative_config
    if runner == "pooling":
        raise ValueError("speculative_config applies only to generative models (runner='generate')")
    if spec.method == "draft_model":
        assert spec.model is not None
        spec = replace(
            spec, model=_resolve_model_path(spec.model, _gguf_file(spec.model, "auto"), cache_root)
        )
        check_draft_model(spec, hf)
    elif spec.method == "eagle3":
        from axon.spec_decode.eagle3 import check_eagle3_config

        assert spec.model is not None
        check_eagle3_config(spec.model, hf)
    return replace(config.speculative_config, speculative_config=spec.to_dict())


def _check_structured_outputs(so: StructuredOutputsConfig) -> None:
    parse_structured_outputs_config(so.structured_outputs_config)
    if so.reasoning_parser is not None:
        get_reasoning_parser(so.reasoning_parser)


def _resolve_runner(runner: str, model_class: type, hf: dict[str, Any]) -> str:
    """auto: what the architecture says. A decoder may also pool (Qwen3-Embedding); an encoder
    cannot generate."""
    pooling = is_pooling_model(model_class)
    if runner == "auto":
        return "pooling" if pooling else "generate"
    fits = can_pool(model_class) if runner == "pooling" else not pooling
    if not fits:
        kind = "an embedding (pooling)" if pooling else "a generative"
        raise ValueError(
            f"runner {runner!r} does not fit architecture {hf.get('architectures')!r}, which is {kind} model"
        )
    return runner


def _gguf_file(model: str | None, load_format: str) -> str | None:
    """The GGUF file ``model`` names (None: the bundled one), or None when it is no GGUF file."""
    path = os.path.expanduser(model) if model is not None else default_model_path()
    return path if os.path.isfile(path) and (path.endswith(".gguf") or load_format == "gguf") else None


def _check_quantization(
    method: str | None, gguf_file: str | None, hf: dict[str, Any], model_path: str
) -> None:
    """gguf needs a GGUF file; a checkpoint quantized in a format axon does not read is refused by name."""
    if method == "gguf" and gguf_file is None:
        raise ValueError(f"quantization 'gguf' needs a .gguf model file, got the folder {model_path!r}")
    given = hf.get("quantization_config")
    if given is not None:
        fmt = given.get("quant_method", "unknown") if isinstance(given, dict) else given
        if fmt == "mxfp4" and "GptOssForCausalLM" in (hf.get("architectures") or []):
            return  # OpenAI's MXFP4 experts: dequantized at load (axon/model/loader/mxfp4.py)
        raise ValueError(
            f"{model_path} is a checkpoint quantized as {fmt!r} (its config.json's quantization_config), "
            "which axon does not read; give an unquantized checkpoint (bfloat16/float16/float32) and "
            "--quantization int8|int4|fp8|w8a8, or a GGUF file"
        )


def _resolve_model_path(model: str | None, gguf_file: str | None, cache_root: str) -> str:
    """The HF folder to load: ``model``'s, or the one ``gguf_file`` (``_gguf_file(model, ...)``)
    converts into."""
    if gguf_file is not None:
        return gguf_to_hf_folder(gguf_file, cache_root)
    path = os.path.expanduser(model if model is not None else default_model_path())
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {path!r} has no config.json")
        return path
    if os.path.isfile(path):
        raise ValueError(f"model file {path!r} is not a .gguf file; pass a GGUF file or an HF folder")
    raise ValueError(
        f"model {model!r} is neither a local folder nor a .gguf file (axon never downloads models)"
    )
