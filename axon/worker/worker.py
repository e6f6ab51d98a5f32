"""Worker: one device, the model on it, its KV cache tensors, and the model runner."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from axon.config import AxonConfig, blocks_per_seq, inductor_options
from axon.distributed.parallel_state import DistributedInit, init_tensor_parallel, set_expert_parallel
from axon.kv_transfer.base import KVConnectorWorker
from axon.kv_transfer.config import parse_kv_transfer_config
from axon.kv_transfer.ec_connector import make_ec_connector
from axon.kv_transfer.factory import make_worker_connector
from axon.metrics.profiler import Profiler, parse_profiler_config
from axon.model.layers.attention import get_attention_backend
from axon.model.layers.linear import resolve_linear_backend
from axon.model.layers.lora import wrap_lora_layers
from axon.model.loader.model_loader import load_model
from axon.model.pooler import model_pooler_config
from axon.model.registry import is_encoder_only
from axon.platforms import (
    huge_page_zeros,
    kv_budget_within_share,
    resolve_device,
    resolve_dtype,
    total_memory_bytes,
)
from axon.platforms.cpu_kernels import cpu_kernels_loaded
from axon.platforms.cpu_threads import configure_cpu_threads, init_cpu_process
from axon.scheduler_output import CompileEvent, ModelRunnerOutput, SchedulerOutput
from axon.spec_decode.registry import make_proposer
from axon.startup import startup_phase
from axon.version import __version__
from axon.worker.buckets import Buckets
from axon.worker.compiler import BucketCompiler, compile_cache_key
from axon.worker.lora import LoRAManager
from axon.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# kv_cache_space_gib "auto" on the CPU: what max_num_seqs full-length sequences need, at most
# this many GiB and at most this share of the machine's memory (weights and activations need
# the rest).
AUTO_CPU_KV_CAP_GIB = 4.0
AUTO_CPU_KV_MAX_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class KVCacheDecision:
    num_blocks: int
    reason: str  # how the number was reached, for the start-up log


def decide_num_blocks(
    config: AxonConfig,
    bytes_per_block: int,
    device_type: str,
    total_bytes: int,
    used_bytes: int = 0,
    window: int | None = None,
) -> KVCacheDecision:
    """The number of KV blocks, from the config and facts of the machine only.

    Deliberately not from free memory: free memory differs between two starts on the same
    machine (page cache, other processes), and so did the cache size (8,604 then 4,269 blocks).
    ``used_bytes``: what the device has in use already (on CUDA: this engine's weights, other
    processes), taken out of ``gpu_memory_utilization``'s share as vLLM does. ``window``: the
    KV cache's sliding-window group, whose blocks a sequence holds too.
    """
    cache, sched = config.cache_config, config.scheduler_config
    if cache.num_gpu_blocks_override is not None:
        n = cache.num_gpu_blocks_override
        return KVCacheDecision(n, f"{n} blocks (num_gpu_blocks_override)")
    max_model_len = config.model_config.max_model_len
    assert max_model_len is not None, "resolve_config() sets max_model_len"
    if device_type == "cuda":
        budget = kv_budget_within_share(total_bytes - used_bytes, total_bytes, cache.gpu_memory_utilization)
        why = (
            f"gpu_memory_utilization {cache.gpu_memory_utilization} of {total_bytes / _GIB:.2f} GiB "
            f"less {used_bytes / _GIB:.2f} GiB in use = {budget / _GIB:.2f} GiB"
        )
    elif cache.kv_cache_space_gib is not None:
        budget = int(cache.kv_cache_space_gib * _GIB)
        why = f"kv_cache_space_gib {cache.kv_cache_space_gib:g} GiB"
    else:
        # (Unresolved, a step's tokens are at most max_model_len: a bound, for the window group.)
        step_tokens = sched.max_num_batched_tokens or max_model_len
        per_seq = blocks_per_seq(max_model_len, config.scheduler_block_size, window, step_tokens)
        need = (sched.max_num_seqs * per_seq + 1) * bytes_per_block
        budget, limit = min(
            (need, "what they need"),
            (int(AUTO_CPU_KV_CAP_GIB * _GIB), f"the {AUTO_CPU_KV_CAP_GIB:g} GiB cap"),
            (
                int(total_bytes * AUTO_CPU_KV_MAX_MEMORY_FRACTION),
                f"{AUTO_CPU_KV_MAX_MEMORY_FRACTION:g} of {total_bytes / _GIB:.1f} GiB memory",
            ),
            key=lambda option: option[0],
        )
        why = (
            f"auto: max_num_seqs {sched.max_num_seqs} x max_model_len {max_model_len} need "
            f"{need / _GIB:.2f} GiB; using {budget / _GIB:.2f} GiB ({limit})"
        )
    num_blocks = max(budget // bytes_per_block, 1)
    return KVCacheDecision(num_blocks, f"{num_blocks} blocks of {bytes_per_block} bytes from {why}")


class Worker:
    """``dist_init``: how this worker joins its tensor-parallel group (from the executor; None:
    the one rank of a ``uni`` executor)."""

    def __init__(self, config: AxonConfig, dist_init: DistributedInit | None = None) -> None:
        self.config = config
        self.rank = dist_init.rank if dist_init is not None else 0
        # This rank's place among the ranks on its host, whose CPUs they split.
        local_rank, local_size = 0, config.parallel_config.tensor_parallel_size
        if dist_init is not None:
            local_rank = dist_init.rank if dist_init.local_rank is None else dist_init.local_rank
            local_size = dist_init.size if dist_init.local_size is None else dist_init.local_size
        self.device = resolve_device(config.device_config.device)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device)
        t0 = time.perf_counter()
        cache_root = config.model_config.cache_root
        assert cache_root is not None, "resolve_config() sets cache_root"
        # vLLM's --seed: requests that give no seed draw from this process's generator, so the
        # same engine seed and the same traffic give the same samples.
        torch.manual_seed(config.model_config.seed)
        d = config.device_config
        p = config.parallel_config
        num_local_cores = (
            p.data_parallel_size if p.data_parallel_size_local is None else p.data_parallel_size_local
        )
        cpu_kernels, self.thread_cpus = init_cpu_process(
            self.device,
            cache_root,
            d.num_threads,
            d.omp_threads_bind,
            # Among the engine cores of this host: ranks S..S+L-1 (data_parallel_start_rank,
            # data_parallel_size_local; a headless host's are not the first N).
            rank=(p.data_parallel_rank - p.data_parallel_start_rank) * local_size + local_rank,
            world=num_local_cores * local_size,
        )
        if dist_init is not None:
            init_tensor_parallel(
                dist_init, self.device, cpu_kernels, p.decode_context_parallel_size, p.attention_dp_size > 1
            )
        set_expert_parallel(config.parallel_config.enable_expert_parallel)
        self.attention_backend = _attention_backend_name(
            config.compilation_config.attention_backend, self.device, cpu_kernels
        )
        backend = get_attention_backend(self.attention_backend, cache_root)
        self.kv_dtype = _kv_cache_dtype(
            config.cache_config.kv_cache_dtype, self.dtype, self.attention_backend
        )
        self.linear_backend = resolve_linear_backend(
            config.compilation_config.linear_backend, self.dtype, self.device, cpu_kernels
        )
        self.model = load_model(
            config.model_config,
            self.dtype,
            self.device,
            backend,
            self.linear_backend,
            linear_batch_hint=config.scheduler_config.max_num_seqs,
        )
        lora_manager = None
        lo = config.lora_config
        if lo.enable_lora:  # before any graph compiles: the graphs hold the LoRA ops
            layers = wrap_lora_layers(self.model, lo.max_loras, lo.max_lora_rank, self.dtype, self.device)
            lora_manager = LoRAManager(
                layers, lo.max_loras, lo.max_cpu_loras or lo.max_loras, lo.max_lora_rank
            )
        self.model_load_time_s = time.perf_counter() - t0
        hf = config.model_config.hf_config or {}
        self.buckets = Buckets.from_config(config)
        # An encoder's attention keeps no KV: it attends over each whole prompt of the step.
        self.encoder_only = is_encoder_only(self.model)
        self.compiler = None if config.compilation_config.enforce_eager else self._make_compiler()
        pooling = config.model_config.runner == "pooling"
        self.proposer = make_proposer(
            config,
            self.model,
            self.dtype,
            self.device,
            backend,
            self.linear_backend,
            config.scheduler_config.max_num_seqs,
        )
        self.runner = ModelRunner(
            self.model,
            config.cache_config.block_size,
            hf["vocab_size"],
            self.device,
            buckets=self.buckets,
            compiler=self.compiler,
            pooling_type=model_pooler_config(config.model_config).pooling_type if pooling else None,
            proposer=self.proposer,
            ec_connector=make_ec_connector(config.kv_transfer_config.ec_transfer_config),
            lora_manager=lora_manager,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._profiler: Profiler | None = None
        self.kv_connector: KVConnectorWorker | None = None  # disaggregated serving
        self.kv_window = self._decide_kv_window()

    def _make_compiler(self) -> BucketCompiler:
        m, c = self.config.model_config, self.config.cache_config
        tp = self.config.parallel_config.tensor_parallel_size
        dcp = self.config.parallel_config.decode_context_parallel_size
        key = compile_cache_key(
            {
                # A rank's graphs: its shapes and its collectives (absent with one rank, so
                # caches from before tensor parallelism stay valid).
                **({"tensor_parallel": (self.rank, tp)} if tp > 1 else {}),
                **({"decode_context_parallel": dcp} if dcp > 1 else {}),
                # The model by its config, not its folder: a host whose folder lies elsewhere
                # (another cache root, another mount) shares the graphs (compile_cache_store).
                "hf_config": m.hf_config,
                "dtype": str(self.dtype),
                "device": self.device.type,
                "block_size": c.block_size,
                "attention_backend": self.attention_backend,
                "linear_backend": self.linear_backend,
                "torch": torch.__version__,
                "axon": __version__,
            }
        )
        assert m.cache_root is not None, "resolve_config() sets cache_root"
        comp = self.config.compilation_config
        store = comp.compile_cache_store or os.environ.get("AXON_COMPILE_CACHE_STORE")
        return BucketCompiler(
            self.model,
            self.model.attention_layers(),
            self.buckets.token_sizes,
            c.block_size,
            self.device,
            cache_dir=os.path.join(m.cache_root, "compile", key),
            policy=comp.bucket_compile,
            store_dir=os.path.join(store, key) if store else None,
            inductor_options=inductor_options(comp, self.device.type),
        )

    def compile_or_warm_up_model(self) -> list[CompileEvent]:
        """Under bucket_compile="warmup", compile every bucket now (the KV cache is bound); the
        compile events."""
        if self.compiler is None:
            logger.info("enforce_eager: every step runs eagerly, nothing is compiled")
            return []
        if self.compiler.policy == "warmup":
            sizes = self.compiler.token_sizes
            with startup_phase(f"compiling {len(sizes)} buckets {list(sizes)} (bucket_compile=warmup)"):
                self.compiler.warmup()
        else:
            logger.info(
                "bucket_compile=on_demand: buckets run eagerly until the idle engine compiles "
                "the ones traffic reached"
            )
        return self.compiler.take_events()

    def compile_pending(self) -> list[CompileEvent]:
        """Compile the buckets traffic reached (the engine is idle); the compile events (empty:
        nothing was pending)."""
        if self.compiler is None or not self.compiler.has_pending:
            return []
        self.compiler.compile_pending()
        return self.compiler.take_events()

    def _kv_layers(self) -> list[list]:
        """The layers of every model whose KV the cache holds, each model's indexed from 0: the
        target's, and a draft's, all of ``num_blocks`` blocks."""
        groups = [list(self.model.attention_layers())]
        if self.proposer is not None and self.proposer.kv_layers():
            groups.append(self.proposer.kv_layers())
        return groups

    def kv_cache_window(self) -> int | None:
        """The sliding window of the KV cache's window group (vLLM's hybrid KV cache manager,
        axon/core/kv_cache_manager.py): a model with both full and sliding-window layers (one
        window) keeps its sliding layers' blocks apart and frees those out of the window. None:
        one group (also when a feature needs one: a KV connector, context or attention data
        parallelism, a draft with windows, or --disable-hybrid-kv-cache-manager)."""
        return self.kv_window

    def _decide_kv_window(self) -> int | None:
        """``kv_cache_window``'s answer, decided once (and logged once) at start-up."""
        if self.encoder_only:
            return None
        target, *drafts = self._kv_layers()
        windows = {layer.spec.sliding_window for layer in target}
        if None not in windows or len(windows) != 2:
            return None  # no sliding layer, only sliding layers, or several windows
        c, p = self.config, self.config.parallel_config
        reason = None
        if c.cache_config.disable_hybrid_kv_cache_manager:
            reason = "--disable-hybrid-kv-cache-manager"
        elif c.kv_transfer_config.kv_transfer_config is not None:
            reason = "a KV connector moves whole blocks of every layer"
        elif p.decode_context_parallel_size > 1 or p.attention_dp_size > 1:
            reason = "context or attention data parallelism"
        elif any(layer.spec.sliding_window is not None for layers in drafts for layer in layers):
            reason = "the draft model has sliding-window layers"
        if reason is not None:
            logger.info("KV cache: one group of blocks for every layer (%s)", reason)
            return None
        return max(w for w in windows if w is not None)

    def _kv_tensor_slots(self) -> list[list[int]]:
        """For each model of ``_kv_layers``, which of its cache tensors each layer uses. With a
        window group, the i-th full layer and the i-th sliding layer share tensor i (a block id
        belongs to one group at a time, so they never use the same block); else one each."""
        slots = []
        for n, layers in enumerate(self._kv_layers()):
            if n > 0 or self.kv_window is None:
                slots.append(list(range(len(layers))))
                continue
            counts = {True: 0, False: 0}
            model_slots = []
            for layer in layers:
                sliding = layer.spec.sliding_window is not None
                model_slots.append(counts[sliding])
                counts[sliding] += 1
            slots.append(model_slots)
        return slots

    def bytes_per_block(self) -> int:
        """K and V of one block in every cache tensor (the draft's included)."""
        block_size, elem = self.config.cache_config.block_size, self.kv_dtype.itemsize
        total = 0
        for layers, slots in zip(self._kv_layers(), self._kv_tensor_slots(), strict=True):
            sizes = {slot: 2 * block_size * layer.spec.num_kv_heads * layer.spec.head_dim * elem
                     for layer, slot in zip(layers, slots, strict=True)}  # fmt: skip
            total += sum(sizes.values())
        return total

    def determine_num_blocks(self) -> int:
        """KV blocks this worker can hold (block 0, the null block, included). An encoder holds
        none: its blocks only count the scheduler's admission (max_num_seqs full prompts)."""
        if self.encoder_only:
            c = self.config
            assert c.model_config.max_model_len is not None
            per_seq = blocks_per_seq(c.model_config.max_model_len, c.scheduler_block_size)
            logger.info("KV cache: none (encoder-only attention)")
            return c.scheduler_config.max_num_seqs * per_seq + 1
        total = total_memory_bytes(self.device)
        # On CUDA, what the whole device has in use: this engine's weights and other processes.
        used = total - torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        decision = decide_num_blocks(
            self.config, self.bytes_per_block(), self.device.type, total, used, self.kv_window
        )
        logger.info("KV cache size: %s", decision.reason)
        p = self.config.parallel_config
        if p.attention_dp_size > 1 and self.config.cache_config.num_gpu_blocks_override is None:
            # Each rank writes only its own requests' blocks, and a CPU cache's pages become
            # resident as they are first written: the ranks' budgets add up to one pool of ids.
            logger.info(
                "attention data parallelism: %d ranks' budgets make one pool of %d blocks, each rank "
                "holding its own requests'",
                p.attention_dp_size,
                decision.num_blocks * p.attention_dp_size,
            )
            return decision.num_blocks * p.attention_dp_size
        return decision.num_blocks

    def start_profile(self) -> None:
        """A worker process of a multi-rank executor profiles itself (``profiler_config``)."""
        settings = parse_profiler_config(self.config.observability_config.profiler_config)
        if settings is not None:
            if self._profiler is None:
                self._profiler = Profiler(settings, f"axon-worker-rank{self.rank}")
            self._profiler.start()

    def stop_profile(self) -> str | None:
        return self._profiler.stop() if self._profiler is not None else None

    def sleep(self) -> None:
        """Release the KV cache's memory. Each cache tensor keeps its identity (the attention
        layers and compiled graphs hold it) and becomes empty; ``wake_up`` gives it storage of
        its old shape again, zeroed."""
        self._slept_shapes = [tuple(t.shape) for kv in self.kv_caches for t in kv]
        for kv in self.kv_caches:
            for t in kv:
                t.set_(torch.empty(0, dtype=t.dtype, device=t.device))

    def wake_up(self) -> None:
        shapes = iter(self._slept_shapes)
        for kv in self.kv_caches:
            for t in kv:
                t.set_(_zeros(next(shapes), t.dtype, self.device))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.encoder_only:  # nothing is written or read: the layers only learn their index
            for i, layer in enumerate(self.model.attention_layers()):
                layer.bind_kv_cache(i, None)
            return
        block_size = self.config.cache_config.block_size
        self.kv_caches = []
        gib = num_blocks * self.bytes_per_block() / _GIB
        size = f"{num_blocks} blocks of {block_size} tokens ({gib:.2f} GiB, {self.kv_dtype})"
        if (window := self.kv_window) is not None:
            size += (
                f"; the sliding-window layers' blocks apart (window {window}: blocks out of it are "
                "freed), each cache tensor shared by a full and a sliding layer"
            )
        if (dcp := self.config.parallel_config.decode_context_parallel_size) > 1:
            size += (
                f", each block id {block_size * dcp} positions across {dcp} ranks (decode context parallel)"
            )
        if self.device.type == "cpu":
            # The process's RSS grows by up to this much as blocks are first used (README,
            # "Memory of the engine process").
            size += ", resident as blocks are first used"
        with startup_phase(f"allocating the KV cache: {size}"):
            for layers, slots in zip(self._kv_layers(), self._kv_tensor_slots(), strict=True):
                # An FP8 cache's per-layer (k_scale, v_scale): 1.0, or 0 to be calculated from
                # the first step (calculate_kv_scales); the kernel reads and sets them in place.
                fp8 = self.kv_dtype.itemsize == 1
                initial = 0.0 if self.config.cache_config.calculate_kv_scales else 1.0
                scales = torch.full((len(layers), 2), initial) if fp8 else None
                tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for i, (layer, slot) in enumerate(zip(layers, slots, strict=True)):
                    shape = (num_blocks, block_size, layer.spec.num_kv_heads, layer.spec.head_dim)
                    if slot not in tensors:
                        tensors[slot] = (
                            _zeros(shape, self.kv_dtype, self.device),
                            _zeros(shape, self.kv_dtype, self.device),
                        )
                        self.kv_caches.append(tensors[slot])
                    kv = tensors[slot]
                    assert tuple(kv[0].shape) == shape, "layers sharing a cache tensor must have one KV shape"
                    layer.bind_kv_cache(i, kv, scales)
        settings = parse_kv_transfer_config(self.config.kv_transfer_config.kv_transfer_config)
        if settings is not None:
            self.kv_connector = make_worker_connector(
                settings, block_size, self.config.parallel_config.data_parallel_rank
            )
            m = self.config.model_config
            self.kv_connector.model_identity = (
                f"{m.model_path} quantization={m.quantization} dtype={self.dtype} kv={self.kv_dtype}"
            )
            self.kv_connector.register_kv_caches(self.kv_caches)

    def init_thread(self) -> None:
        """Set up intra-op threads for another calling thread (async scheduling's step thread)."""
        if self.device.type == "cpu":
            d = self.config.device_config
            configure_cpu_threads(self.thread_cpus, d.num_threads, cpu_kernels_loaded())

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.kv_connector
        if connector is None:
            return self.runner.execute_model(scheduler_output)
        # The loads this step starts are for requests that do not run in it (they wait for
        # them); what the step computed is saved after the forward.
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv()
        output = self.runner.execute_model(scheduler_output)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        if scheduler_output.total_num_scheduled_tokens == 0:
            connector.progress(_IDLE_PROGRESS_S)
        output.kv_connector_output = connector.get_finished(scheduler_output.finished_req_ids)
        return output

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None


# How long a step with nothing to compute drives the KV transfers in flight (a transport with no
# thread of its own, like NIXL's here, moves bytes only while it is polled).
_IDLE_PROGRESS_S = 0.005

_FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _kv_cache_dtype(name: str, model_dtype: torch.dtype, attention_backend: str) -> torch.dtype:
    """The cache's element type: the model's, or an FP8 type, which only the C++ kernel reads."""
    if name == "auto":
        return model_dtype
    if attention_backend != "cpu_flash":
        raise ValueError(
            f"kv_cache_dtype {name!r} needs attention_backend 'cpu_flash' (axon's C++ CPU kernel, "
            f"the CPU default), got {attention_backend!r}"
        )
    return _FP8_KV_DTYPES[name]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor; on the CPU in huge pages, zeroed by the kernel on first touch."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_page_zeros(shape, dtype)


def _attention_backend_name(name: str, device: torch.device, cpu_kernels: bool) -> str:
    """auto: on the CPU the C++ kernel, or the pure-torch paged one where the kernels could not
    be built; torch SDPA over the block table elsewhere."""
    if name != "auto":
        return name
    if device.type != "cpu":
        return "reference"
    return "cpu_flash" if cpu_kernels else "cpu_paged"
