"""LLMEngine: the in-process pipeline, InputProcessor -> EngineCore -> OutputProcessor.

Used by the offline ``LLM`` and the CLI; the server runs the same EngineCore in its own process.
"""

from __future__ import annotations

import itertools
from typing import Any

from axon.config import AxonConfig
from axon.engine.core import make_engine_core
from axon.engine.input_processor import InputProcessor, PromptType
from axon.engine.output_processor import AnyRequestOutput, OutputProcessor, ParentRequest, PoolingRequest
from axon.engine.pooling_inputs import PoolingInputProcessor
from axon.engine.tokenizer import load_tokenizer
from axon.lora.request import LoRARequest
from axon.pooling_params import PoolingParams
from axon.sampling_params import RequestOutputKind, SamplingParams
from axon.startup import freeze_start_up_heap


class LLMEngine:
    def __init__(self, config: AxonConfig) -> None:
        _refuse_data_parallel(config)
        self.config = config
        model_config = config.model_config
        self.tokenizer = load_tokenizer(model_config)
        self.input_processor = InputProcessor(model_config, self.tokenizer, config.lora_config)
        pooling = model_config.runner == "pooling"
        self.pooling_inputs = PoolingInputProcessor(config, self.input_processor) if pooling else None
        self.engine_core = make_engine_core(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._child_ids: dict[str, list[str]] = {}
        self._counter = itertools.count()
        freeze_start_up_heap()  # the engine core runs in this process

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and enqueue one request (n children when params.n > 1). Raises ValueError."""
        if self.engine_core.is_sleeping():
            raise ValueError("the engine is sleeping: call wake_up() first")
        request_id = request_id if request_id is not None else str(next(self._counter))
        text, prompt_token_ids, children = self.input_processor.process(
            request_id, prompt, params, lora_request
        )
        self.output_processor.check_new_ids([c.req_id for c in children])
        parent = ParentRequest(request_id, text, prompt_token_ids, params.n, output_kind)
        for index, core_request in enumerate(children):
            self.output_processor.add_request(parent, core_request.req_id, index, params)
            self.engine_core.add_request(core_request)
        self._child_ids[request_id] = [c.req_id for c in children]
        return request_id

    def add_pooling_request(self, prompt: PromptType, params: PoolingParams) -> str:
        """Validate and enqueue one embedding request. Raises ValueError."""
        assert self.pooling_inputs is not None, "an embedding model (runner='pooling') pools"
        request_id = str(next(self._counter))
        item = self.pooling_inputs.process(request_id, prompt, params)
        self.output_processor.check_new_ids([request_id])
        core = item.request
        self.output_processor.add_pooling_request(
            PoolingRequest(request_id, item.prompt, core.prompt_token_ids)
        )
        self.engine_core.add_request(core)
        self._child_ids[request_id] = [request_id]
        return request_id

    def abort_request(self, request_ids: list[str]) -> None:
        child_ids = [c for r in request_ids for c in self._child_ids.pop(r, [])]
        self.engine_core.abort_requests(child_ids)
        self.output_processor.abort_requests(child_ids)

    def step(self) -> list[AnyRequestOutput]:
        core_outputs = self.engine_core.step()
        request_outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:
            self.engine_core.abort_requests(stopped)  # a stop string ended them: free their KV now
        for out in request_outputs:
            if out.finished:
                self._child_ids.pop(out.request_id, None)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache's memory until ``wake_up`` (enable_sleep_mode)."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep needs the engine started with enable_sleep_mode (--enable-sleep-mode)")
        problem = self.engine_core.sleep(level)
        if problem is not None:
            raise ValueError(problem)

    def wake_up(self) -> None:
        self.engine_core.wake_up()

    def get_tokenizer(self) -> Any:
        return self.tokenizer


def _refuse_data_parallel(config: AxonConfig) -> None:
    """The in-process engine runs one core; several are the server's (one process each)."""
    size = config.parallel_config.data_parallel_size
    if size > 1:
        raise ValueError(
            f"data_parallel_size {size}: the offline LLM (and axon generate / axon chat) runs one "
            "engine core in this process; to run several behind one endpoint, serve the model "
            f"with `axon serve --data-parallel-size {size}`"
        )
