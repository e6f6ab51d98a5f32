"""AsyncPoolingLLM: the server's embedding engine, with AsyncLLM's life-cycle surface.

An embedding model is small and runs no decode loop, so it runs in the server process: the
``PoolingEngine`` is built and called on a worker thread (one batch at a time, under a lock),
which keeps the event loop free. ``start``/``shutdown``/``is_alive``/``watch_process``/``errored``
match ``AsyncLLM`` so the server's life cycle treats both alike.
"""

from __future__ import annotations

import asyncio
from typing import Any

from axon.config import AxonConfig
from axon.engine.input_processor import PromptType
from axon.engine.pooling_engine import PoolingEngine
from axon.metrics.stats import StatLogger
from axon.outputs import EmbeddingRequestOutput
from axon.pooling_params import PoolingParams


class AsyncPoolingLLM:
    def __init__(
        self,
        config: AxonConfig,
        stat_loggers: list[StatLogger] | None = None,
        chat_template: str | None = None,
    ) -> None:
        del stat_loggers, chat_template  # no scheduler stats; embeddings use no chat template
        self.config = config
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
        return self._engine is not None and not self.errored

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
        async with self._lock:
            return await asyncio.to_thread(self.engine.embed, prompts, params)
