"""Worker: one device, the model on it, its KV cache tensors, and the model runner."""

from __future__ import annotations

import logging
import os
import time

import torch

import axon
from axon.config import AxonConfig
from axon.core.kv_cache_utils import cdiv
from axon.core.scheduler_output import CompileEvent, ModelRunnerOutput, SchedulerOutput
from axon.model.layers.attention import get_attention_backend
from axon.model.layers.linear import resolve_linear_backend
from axon.model.loader.model_loader import load_model
from axon.platforms import available_memory_bytes, huge_page_zeros, resolve_device, resolve_dtype
from axon.platforms.cpu_kernels import cpu_kernels_loaded
from axon.platforms.cpu_threads import configure_cpu_threads, init_cpu_process
from axon.worker.buckets import resolve_buckets
from axon.worker.compiler import BucketCompiler, compile_cache_key
from axon.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GIB = 1 << 30
_AUTO_CPU_KV_CAP_GIB = 4.0


class Worker:
    def __init__(self, config: AxonConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device_config.device)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device)
        t0 = time.perf_counter()
        cache_root = config.model_config.cache_root
        assert cache_root is not None, "resolve_config() sets cache_root"
        d = config.device_config
        cpu_kernels, self.thread_cpus = init_cpu_process(self.device, cache_root, d.num_threads, d.omp_threads_bind)
        self.attention_backend = _attention_backend_name(
            config.compilation_config.attention_backend, self.device, cpu_kernels
        )
        backend = get_attention_backend(self.attention_backend, cache_root)
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
        self.model_load_time_s = time.perf_counter() - t0
        hf = config.model_config.hf_config or {}
        self.buckets = resolve_buckets(config)
        self.compiler = None if config.compilation_config.enforce_eager else self._make_compiler()
        self.runner = ModelRunner(
            self.model,
            config.cache_config.block_size,
            hf["vocab_size"],
            self.device,
            buckets=self.buckets,
            compiler=self.compiler,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _make_compiler(self) -> BucketCompiler:
        m, c = self.config.model_config, self.config.cache_config
        key = compile_cache_key(
            {
                "model": m.model_path,
                "hf_config": m.hf_config,
                "dtype": str(self.dtype),
                "device": self.device.type,
                "block_size": c.block_size,
                "attention_backend": self.attention_backend,
                "linear_backend": self.linear_backend,
                "torch": torch.__version__,
                "axon": axon.__version__,
            }
        )
        assert m.cache_root is not None, "resolve_config() sets cache_root"
        return BucketCompiler(
            self.model,
            self.model.attention_layers(),
            self.buckets.token_sizes,
            c.block_size,
            self.device,
            cache_dir=os.path.join(m.cache_root, "compile", key),
            policy=self.config.compilation_config.bucket_compile,
        )

    def compile_or_warm_up_model(self) -> None:
        """Under bucket_compile="warmup", compile every bucket now (the KV cache is bound)."""
        if self.compiler is not None and self.compiler.policy == "warmup":
            self.compiler.warmup()

    def take_compile_events(self) -> list[CompileEvent]:
        return self.compiler.take_events() if self.compiler is not None else []

    def compile_pending(self) -> bool:
        """Compile the buckets traffic reached (the engine is idle). True if any was."""
        if self.compiler is None or not self.compiler.has_pending:
            return False
        self.compiler.compile_pending()
        return True

    def bytes_per_block(self) -> int:
        arch = self.model.arch
        elem = self.dtype.itemsize
        return (
            2
            * arch.num_layers
            * self.config.cache_config.block_size
            * arch.num_kv_heads
            * arch.head_dim
            * elem
        )

    def determine_num_blocks(self) -> int:
        """KV blocks this worker can hold (block 0, the null block, included)."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.bytes_per_block()
        max_model_len = self.config.model_config.max_model_len
        assert max_model_len is not None
        if self.device.type == "cuda":
            budget = int(available_memory_bytes(self.device) * cache.gpu_memory_utilization)
        elif cache.kv_cache_space_gib is not None:
            budget = int(cache.kv_cache_space_gib * _GIB)
        else:
            # Enough for max_num_seqs full-length sequences, within a share of free memory.
            need = (sched.max_num_seqs * cdiv(max_model_len, cache.block_size) + 1) * per_block
            budget = min(need, int(_AUTO_CPU_KV_CAP_GIB * _GIB), available_memory_bytes(self.device) // 4)
        return max(budget // per_block, 1)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        arch = self.model.arch
        shape = (num_blocks, self.config.cache_config.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = []
        for i, layer in enumerate(self.model.attention_layers()):
            kv = (_zeros(shape, self.dtype, self.device), _zeros(shape, self.dtype, self.device))
            layer.bind_kv_cache(i, kv)
            self.kv_caches.append(kv)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)%s",
            num_blocks,
            self.config.cache_config.block_size,
            num_blocks * self.bytes_per_block() / _GIB,
            # The process's RSS grows by up to this much as blocks are first used (README,
            # "Memory of the engine process").
            ", resident as blocks are first used" if self.device.type == "cpu" else "",
        )

    def init_thread(self) -> None:
        """Set up intra-op threads for another calling thread (async scheduling's step thread)."""
        if self.device.type == "cpu":
            d = self.config.device_config
            configure_cpu_threads(self.thread_cpus, d.num_threads, cpu_kernels_loaded())

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


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
