"""The engine core of an encoder server (``--mm-encoder-only``, encoder disaggregation).

It has EngineCore's face (requests in, outputs out, stats) and none of its insides: no
scheduler, no KV cache, no decoder. Each step takes every waiting request, runs the images of
all of them that are not stored yet through the vision tower in one call (their attention
packed, axon/worker/multimodal.py), stores each image's features through the EC connector
(axon/kv_transfer/ec_connector.py) and finishes the requests: no tokens, finish reason
"length". A request is answered only after its images are stored, so the router that waits for
the answer may send the prompt on to a prefill/decode server, which loads them.

The front end in front of it is the usual one: the chat template, image fetching and checks,
errors and metrics are a normal server's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from axon.config import AxonConfig
from axon.engine.core import report_startup_once
from axon.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from axon.kv_transfer.ec_connector import make_ec_connector
from axon.model.layers.linear import resolve_linear_backend
from axon.model.loader.model_loader import load_vision_tower
from axon.platforms import resolve_device, resolve_dtype
from axon.platforms.cpu_threads import init_cpu_process
from axon.worker.multimodal import encode_images

logger = logging.getLogger(__name__)


class EncoderEngineCore:
    def __init__(self, config: AxonConfig) -> None:
        t0 = time.perf_counter()
        m, d = config.model_config, config.device_config
        assert m.cache_root is not None, "resolve_config() sets cache_root"
        self.device = resolve_device(d.device)
        dtype = resolve_dtype(m.dtype, self.device)
        kernels, _ = init_cpu_process(self.device, m.cache_root, d.num_threads, d.omp_threads_bind)
        linear = resolve_linear_backend(config.compilation_config.linear_backend, dtype, self.device, kernels)
        self.tower = load_vision_tower(m, dtype, self.device, linear)
        self.model_load_time_s = time.perf_counter() - t0
        connector = make_ec_connector(config.kv_transfer_config.ec_transfer_config)
        assert connector is not None and connector.settings.is_producer, "resolve_config() checks the role"
        self.connector = connector
        self.num_blocks = 0  # no KV cache
        self.waiting: dict[str, EngineCoreRequest] = {}
        self.num_encoded_images = 0
        self.startup_time_s = time.perf_counter() - t0
        self._reported_startup = False
        logger.info(
            "encoder core ready in %.1f s: the vision tower on %s (%s), features to %s",
            self.startup_time_s,
            self.device,
            dtype,
            connector.root,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.waiting[request.req_id] = request

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.waiting.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    @torch.inference_mode()
    def step(self) -> EngineCoreOutputs:
        batch = list(self.waiting.values())
        self.waiting.clear()
        if not batch:
            return EngineCoreOutputs(outputs=[])
        first_scheduled = time.time()
        images = [i for r in batch for i in r.images or []]
        # Images another request already stored need no work (the file is the cache).
        todo = [i for i in {i.digest: i for i in images}.values() if not self.connector.has(i.digest)]
        if todo:
            encode_images(self.tower, todo, ec=self.connector)
        self.num_encoded_images += len(todo)
        outputs = [
            EngineCoreOutput(
                req_id=r.req_id,
                new_token_ids=[],
                finish_reason="length",
                first_scheduled_time=first_scheduled,
            )
            for r in batch
        ]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def make_stats(self) -> SchedulerStats:
        stats = SchedulerStats(num_running_reqs=0, num_waiting_reqs=len(self.waiting))
        report_startup_once(self, stats)
        return stats

    def reset_prefix_cache(self) -> bool:
        return True  # no KV cache

    def start_profile(self) -> bool:
        return False

    def stop_profile(self) -> list[str]:
        return []

    def sleep(self, level: int = 1) -> str | None:
        return None  # no KV cache to release

    def wake_up(self) -> None:
        pass

    def is_sleeping(self) -> bool:
        return False

    def compile_pending(self) -> bool:
        return False  # the tower runs eagerly

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
