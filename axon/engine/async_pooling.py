"""AsyncPoolingLLM: the server's embedding engine, with AsyncLLM's life-cycle surface.

An embedding model is small and runs no decode loop, so it runs in the server process: the
``PoolingEngine`` is built and called on a worker thread (one batch at a time, under a lock),
which keeps the event loop free. ``start``/``shutdown``/``is_alive``/``health_problem``/
``watch_process``/``errored`` match ``AsyncLLM`` so the server's life cycle treats both alike. Each embedded prompt is one
finished request for the stat loggers (vLLM counts pooling requests the same way): its prompt
tokens, finish reason "stop", and its latency from arrival, waiting for the lock included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from axon.config import AxonConfig
from axon.engine.input_processor import PromptType
from axon.engine.pooling_engine import PoolingEngine
from axon.metrics.stats import FinishedRequestStats, IterationStats, StatLogger
from axon.outputs import EmbeddingRequestOutput, ScoringRequestOutput
from axon.pooling_params import PoolingParams

T = TypeVar("T", list[EmbeddingRequestOutput], list[ScoringRequestOutput])


class AsyncPoolingLLM:
    def __init__(
        self,
        config: AxonConfig,
        stat_loggers: list[StatLogger] | None = None,
        chat_template: str | None = None,
    ) -> None:
        del chat_template  # embeddings use no chat template
        self.config = config
        self.stat_loggers = stat_loggers or []
        self.errored = False
        self.dead_error: str | None = None
        self.num_blocks = 0
        self._engine: PoolingEngine | None = None
        self._lock = asyncio.Lock()
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        self._engine = await asyncio.to_thread(PoolingEngine, self.config)

    async def shutdown(self) -> None:
        self._stopped.set()

    def is_alive(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> tuple[str, str] | None:
        """``(code, message)`` when the engine cannot serve. It runs on this process's threads,
        so it cannot stall apart from the server: only a failed start or a shutdown count."""
        if self.errored:
            return "engine_dead", f"The engine is dead: {self.dead_error}"
        if self._engine is None:
            return "engine_dead", "The engine is not running."
        return None

    async def watch_process(self) -> None:
        """Nothing to watch: the model lives in this process. Returns only at shutdown."""
        await self._stopped.wait()

    @property
    def engine(self) -> PoolingEngine:
        assert self._engine is not None, "start() comes first"
        return self._engine

    @property
    def input_processor(self) -> PoolingEngine:
        # The serving layer reads ``input_processor.vocab_size`` (/detokenize); the engine has it.
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def process(self, prompt: PromptType, params: PoolingParams) -> tuple[str | None, list[int]]:
        """Validate one input without running it (raises ValueError)."""
        return self.engine.process(prompt, params)

    async def embed(
        self, prompts: list[PromptType], params: list[PoolingParams]
    ) -> list[EmbeddingRequestOutput]:
        return await self._run(self.engine.embed, prompts, params)

    async def score(
        self, text_1: list[PromptType], text_2: list[PromptType], params: PoolingParams
    ) -> list[ScoringRequestOutput]:
        return await self._run(self.engine.score, text_1, text_2, params)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """One engine call on the worker thread; its outputs count as finished requests."""
        arrival = time.time()
        async with self._lock:
            started = time.time()
            outputs = await asyncio.to_thread(fn, *args)
        self._record(outputs, arrival, started)
        return outputs

    def _record(self, outputs: T, arrival: float, started: float) -> None:
        stats = IterationStats()
        for out in outputs:
            num_tokens = len(out.prompt_token_ids)
            stats.num_prompt_tokens += num_tokens
            stats.finished_requests.append(
                FinishedRequestStats(
                    finish_reason="stop",
                    e2e_latency=stats.now - arrival,
                    queue_time=started - arrival,
                    num_prompt_tokens=num_tokens,
                    num_generation_tokens=0,
                    max_tokens=None,
                    n=1,
                )
            )
        for stat_logger in self.stat_loggers:
            stat_logger.record(None, stats)
