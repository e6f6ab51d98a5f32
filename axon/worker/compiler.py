"""One compiled graph per bucket, a compile cache on disk, and no wait for compilation.

The model's forward is compiled by torch.compile (Inductor) with static shapes, so each padded
token count (``Buckets.token_sizes``) is its own graph; paged attention stays out of the graphs
as an opaque op (``axon/model/layers/attention/layer.py``). Inductor's graph cache lives under
``<cache_root>/compile/<key>``, where the key hashes everything that changes a graph (model
config, dtype, device, block size, attention backend, torch and axon versions), so a second
start loads every graph instead of generating code.

A shared store (``compile_cache_store``: a folder on NFS or a mounted bucket) extends the cache
across hosts: before compiling, the files of this key's cache that the store has and this host
lacks are copied in; after compiling, the files the store lacks are copied out (each file
written under a temporary name and renamed, so a reader never sees half of one). Nothing in the
key names a path of this host (the model is known by its config, not its folder), so another
host, or a pod with a new cache root, reads the same entries.

Two policies (``bucket_compile``):
  on_demand (default)  a bucket's steps run eagerly at their exact shape until its graph is
                       ready; the buckets traffic reached compile when the engine is idle
                       (``compile_pending``), so only those are compiled and no request waits.
                       Compilation never runs beside a forward: tracing patches module calls
                       process-wide, so a forward on another thread would be traced too.
  warmup               every bucket is compiled before the engine serves (vllm-neuron's way).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import time
import types
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from axon.config import BUCKET_COMPILE_POLICIES
from axon.forward_context import set_forward_context
from axon.model.layers.attention import describe_step
from axon.scheduler_output import CompileEvent

logger = logging.getLogger(__name__)


@dataclass
class CompileRecord:
    seconds: float
    cache_hit: bool


@dataclass
class CompileStats:
    """What compilation did: per padded token count, its time and whether the cache had it."""

    records: dict[int, CompileRecord] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    graph_steps: int = 0  # steps that ran in a compiled graph

    @property
    def num_cache_hits(self) -> int:
        return sum(r.cache_hit for r in self.records.values())


def compile_cache_key(parts: dict[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class BucketCompiler:
    def __init__(
        self,
        model: nn.Module,
        attention_layers: Sequence[nn.Module],
        token_sizes: Sequence[int],
        block_size: int,
        device: torch.device,
        cache_dir: str,
        policy: str,
        store_dir: str | None = None,
        inductor_options: dict[str, Any] | None = None,
    ) -> None:
        assert policy in BUCKET_COMPILE_POLICIES, policy
        self.attention_layers = list(attention_layers)
        self.token_sizes = tuple(token_sizes)
        self.block_size = block_size
        self.device = device
        self.policy = policy
        self.cache_dir, self.store_dir = cache_dir, store_dir
        self.stats = CompileStats()
        self._ready: set[int] = set()
        self._pending: list[int] = []  # reached by traffic, not compiled yet
        self._events: list[CompileEvent] = []  # finished since the last take_events()
        _configure_torch_compile(cache_dir, len(self.token_sizes))
        # One compiled function: static shapes give one graph per token count it is called at.
        # Inductor's options are part of its graph cache's key: other options, other graphs.
        self._compiled: Callable[..., torch.Tensor] = torch.compile(
            model.forward, dynamic=False, fullgraph=True, options=inductor_options or None
        )
        self._model = model
        # Each ready bucket's forward as Dynamo rewrote it (its graph called straight from the
        # bytecode: no cache lookup, no guards); see _capture_direct.
        self._direct: dict[int, Callable[..., torch.Tensor]] = {}
        # Each graph stays resident once built, so the bucket list bounds them (README, "Memory
        # of the engine process").
        logger.info(
            "bucket_compile=%s: at most %d compiled graphs, one per bucket %s",
            policy,
            len(self.token_sizes),
            list(self.token_sizes),
        )

    def warmup(self) -> None:
        self._fetch()
        for n in self.token_sizes:
            self._compile(n)
        self._publish()

    def graph_for(self, num_tokens: int) -> Callable[..., torch.Tensor] | None:
        """The graph for this bucket if it is ready; else None (run eagerly), and under
        on_demand the bucket is remembered for the next ``compile_pending``."""
        if num_tokens in self._ready:
            self.stats.graph_steps += 1
            return self._direct.get(num_tokens, self._run_ready)
        if num_tokens not in self.token_sizes:
            raise ValueError(f"{num_tokens} tokens is not a bucket; buckets: {list(self.token_sizes)}")
        if (
            self.policy == "on_demand"
            and num_tokens not in self._pending
            and num_tokens not in self.stats.failures
        ):
            self._pending.append(num_tokens)
        return None

    def _run_ready(self, *args: torch.Tensor) -> torch.Tensor:
        """A compiled bucket's graph, checking only the guards that tell the graphs apart.

        Dynamo's full guard check (every parameter's dtype, shape and strides, every global the
        trace read) cost 0.4 ms a step on an 8-layer model and 1.3 ms on a 30-layer one, 3-4%
        of a decode step. Nothing those guards watch changes after start-up (weights, caches
        and modules are fixed; the graphs differ only by token count), and this is called only
        for token counts already compiled, so no call can need a new graph.
        """
        with _skip_guard_eval():
            return self._compiled(*args)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def compile_pending(self) -> None:
        """Compile the buckets traffic reached (call it between steps, when idle)."""
        self._fetch()
        while self._pending:
            self._compile(self._pending.pop(0))
        self._publish()

    def _fetch(self) -> None:
        if self.store_dir is not None and os.path.isdir(self.store_dir):
            copied = copy_missing(self.store_dir, self.cache_dir)
            logger.info("compile cache store %s: %d files fetched", self.store_dir, copied)

    def _publish(self) -> None:
        if self.store_dir is not None:
            copied = copy_missing(self.cache_dir, self.store_dir)
            logger.info("compile cache store %s: %d files published", self.store_dir, copied)

    def take_events(self) -> list[CompileEvent]:
        events, self._events = self._events, []
        return events

    def _name(self, num_tokens: int) -> str:
        return f"tokens_{num_tokens}"

    def _compile(self, num_tokens: int) -> None:
        if num_tokens in self._ready:
            return
        counters = torch._dynamo.utils.counters["inductor"]
        hits_before = counters["fxgraph_cache_hit"]
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(), self._capture_direct(num_tokens):
                self._run_empty(num_tokens)
        except Exception as e:  # a bucket that fails to compile stays eager; serving goes on
            logger.exception("compiling the %d-token bucket failed; it runs eagerly", num_tokens)
            self.stats.failures[num_tokens] = f"{type(e).__name__}: {e}"
            return
        seconds = time.perf_counter() - t0
        hit = counters["fxgraph_cache_hit"] > hits_before
        self.stats.records[num_tokens] = CompileRecord(seconds, hit)
        self._events.append(CompileEvent(self._name(num_tokens), seconds, hit))
        self._ready.add(num_tokens)
        logger.info(
            "compiled the %d-token bucket in %.1f s (%s)",
            num_tokens,
            seconds,
            "cache hit" if hit else "cache miss",
        )

    @contextlib.contextmanager
    def _capture_direct(self, num_tokens: int):
        """Keep the bytecode Dynamo makes of the model's forward while this bucket compiles,
        as a function of its own (vLLM dispatches its compiled graphs the same way). Calling
        it runs the bucket's graph with no Dynamo cache lookup and no guard evaluation, which
        cost 0.2 to 0.3 ms a decode step even with only the guards that tell the graphs apart
        (``_run_ready``, the fallback where no bytecode was seen)."""
        forward = self._model.forward.__func__
        seen: list[types.CodeType] = []

        def hook(original: types.CodeType, rewritten: types.CodeType) -> None:
            if original is forward.__code__:
                seen.append(rewritten)

        handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
        try:
            yield
        finally:
            handle.remove()
        if len(seen) == 1:
            rewritten = types.FunctionType(
                seen[0], forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
            )
            self._direct[num_tokens] = functools.partial(rewritten, self._model)

    def _run_empty(self, num_tokens: int) -> None:
        """A forward with no request: every row is padding, so nothing is written or read."""
        dev = self.device
        metadata = describe_step([], self.block_size, dev, num_tokens=num_tokens)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        with set_forward_context(metadata, self.attention_layers):
            self._compiled(ids, ids.clone())


def copy_missing(src: str, dst: str) -> int:
    """Copy every file under ``src`` that ``dst`` lacks (lock and temporary files aside), each
    to a temporary name and renamed, so concurrent readers and writers never see a partial
    file; the number copied."""
    copied = 0
    for folder, _, files in os.walk(src):
        rel = os.path.relpath(folder, src)
        for name in files:
            if name.endswith(".lock") or ".tmp-" in name:
                continue
            target = os.path.normpath(os.path.join(dst, rel, name))
            if os.path.exists(target):
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                shutil.copy2(os.path.join(folder, name), tmp)
                os.replace(tmp, target)
            except FileNotFoundError:  # removed under us (a temporary file of a compile)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
                continue
            copied += 1
    return copied


_HAS_SKIP_GUARD_EVAL = "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


def _skip_guard_eval() -> contextlib.AbstractContextManager:
    # torch >= 2.6 has the stance; older torch checks every guard.
    if _HAS_SKIP_GUARD_EVAL:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


_graphs_in_process = 0  # buckets of every engine this process has built


def _configure_torch_compile(cache_dir: str, num_graphs: int) -> None:
    global _graphs_in_process
    os.makedirs(cache_dir, exist_ok=True)
    # Inductor reads its cache root from the environment whenever it looks one up.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    # Dynamo counts graphs per code object across the process: a second engine's model runs
    # the same forward code, so the limit covers every engine built here, not just this one
    # (past it, Dynamo silently runs the forward eagerly).
    _graphs_in_process += num_graphs
    dynamo = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit_name, max(getattr(dynamo, limit_name), _graphs_in_process + 2))
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * _graphs_in_process)
