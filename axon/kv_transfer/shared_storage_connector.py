"""SharedStorageConnector: prompts' KV blocks pushed to files that any server on the host reads.

Not NIXL's shape: nothing is pulled from a live server and no server waits for a reader. A
prefill server (``kv_producer``) saves the prompt blocks of each request that carries
``do_remote_decode`` into a file right after the step that computed them, before the request's
answer leaves (so the file exists when a decode server is asked), and frees its blocks at once.
A decode server (``kv_consumer``) looks files up by content: the key is a hash of the prompt's
token ids over its full blocks (all but the last prompt token), so any request with that
prompt, with or without ``kv_transfer_params``, loads them instead of recomputing them.

    <shared_storage_path>/<sha256 of the prompt's full blocks' token ids>.kv
        header: magic, JSON {num_blocks, block_size, region_bytes: [bytes of a block, per region],
                model: what computed it (a load checks all but num_blocks against its own)}
        body:   region by region, block by block: the raw cache bytes

``kv_connector_extra_config``: ``shared_storage_path`` (vLLM's key; default /dev/shm/axon-kv),
``ttl_seconds`` (files older than this are deleted by the producer; default 600). A file a
request with ``do_remote_prefill`` loaded is deleted after the load (it was made for it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from axon.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    block_regions,
)

logger = logging.getLogger(__name__)

_MAGIC = b"AXKV1\n"
DEFAULT_PATH = "/dev/shm/axon-kv"


def _storage_path(extra: dict[str, Any]) -> str:
    return str(extra.get("shared_storage_path") or DEFAULT_PATH)


def _full_blocks(prompt_token_ids: list[int], block_size: int) -> int:
    """Blocks a transfer covers: the full ones before the last prompt token (computed locally)."""
    return (len(prompt_token_ids) - 1) // block_size


def file_for(root: str, prompt_token_ids: list[int], block_size: int) -> str:
    num_tokens = _full_blocks(prompt_token_ids, block_size) * block_size
    digest = hashlib.sha256(struct.pack(f"<{num_tokens}q", *prompt_token_ids[:num_tokens])).hexdigest()
    return os.path.join(root, f"{digest}.kv")


@dataclass
class _Load:
    req_id: str
    path: str
    first_block: int  # the file's first block to load (the local prefix-cache hit is skipped)
    block_ids: list[int]  # where they go, in order
    delete_after: bool


@dataclass
class _Save:
    req_id: str
    path: str
    block_ids: list[int]


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


class SharedStorageConnectorScheduler(KVConnectorScheduler):
    def __init__(self, settings: Any, block_size: int, engine_index: int) -> None:
        super().__init__(settings, block_size, engine_index)
        self.root = _storage_path(settings.extra)
        os.makedirs(self.root, exist_ok=True)
        self.ttl_s = settings.extra_number("ttl_seconds", 600)
        self._loads: list[_Load] = []
        self._to_save: dict[str, Any] = {}  # producer: requests to save once their prompt is computed
        self._last_sweep = 0.0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.settings.is_producer and params.get("do_remote_decode"):
            self._to_save[request.req_id] = request
        if not self.settings.is_consumer:
            return 0, False
        num_tokens = _full_blocks(request.prompt_token_ids, self.block_size) * self.block_size
        path = file_for(self.root, request.prompt_token_ids, self.block_size)
        if num_tokens <= num_computed_tokens:
            if params.get("do_remote_prefill"):  # made for this request, which needs none of it
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            return 0, False
        if not os.path.exists(path):
            return 0, False
        return num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        num_blocks = _full_blocks(request.prompt_token_ids, self.block_size)
        first = num_blocks - num_external_tokens // self.block_size
        params = request.kv_transfer_params or {}
        self._loads.append(
            _Load(
                request.req_id,
                file_for(self.root, request.prompt_token_ids, self.block_size),
                first,
                block_ids[first:num_blocks],
                delete_after=bool(params.get("do_remote_prefill")),
            )
        )

    def build_connector_meta(self, scheduler_output: Any) -> SharedStorageMetadata:
        saves = []
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self._to_save.get(req_id)
            if req is None or req.num_computed_tokens < len(req.prompt_token_ids):
                continue  # not this connector's, or its prompt is not all computed yet
            del self._to_save[req_id]
            num_blocks = _full_blocks(req.prompt_token_ids, self.block_size)
            if num_blocks:
                path = file_for(self.root, req.prompt_token_ids, self.block_size)
                saves.append(_Save(req_id, path, self.block_ids_of(req_id)[:num_blocks]))
        if saves:
            self._sweep()
        meta = SharedStorageMetadata(self._loads, saves)
        self._loads = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._to_save.pop(request.req_id, None)
        params = request.kv_transfer_params or {}
        if not (params.get("do_remote_decode") and request.get_finish_reason() == "length"):
            return False, None
        # Saved by the step that computed the prompt: nothing to wait for. The decode server
        # finds the file by the prompt; the params say so in vLLM's words.
        return False, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None}

    def _sweep(self) -> None:
        """Delete files older than ttl_seconds (at most once a second)."""
        now = time.time()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for entry in os.scandir(self.root):
            if entry.name.endswith(".kv") and now - entry.stat().st_mtime > self.ttl_s:
                with contextlib.suppress(FileNotFoundError):  # another server removed it first
                    os.remove(entry.path)


class SharedStorageConnectorWorker(KVConnectorWorker):
    def __init__(self, settings: Any, block_size: int, engine_index: int) -> None:
        super().__init__(settings, block_size, engine_index)
        self.root = _storage_path(settings.extra)
        os.makedirs(self.root, exist_ok=True)
        self.regions: list[torch.Tensor] = []
        self._done: set[str] = set()
        self._failed: set[str] = set()

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.regions = block_regions(kv_caches)
        self.layout = {
            "block_size": self.block_size,
            "region_bytes": [r.shape[1] for r in self.regions],
            "model": self.model_identity,
        }

    def start_load_kv(self) -> None:
        meta = self.metadata
        assert isinstance(meta, SharedStorageMetadata)
        for load in meta.loads:
            t0 = time.perf_counter()
            try:
                num_bytes = self._load(load)
            except (OSError, ValueError) as e:
                logger.warning("KV load of request %s from %s failed: %s", load.req_id, load.path, e)
                self._failed.add(load.req_id)
                self.stats.num_failed_transfers += 1
            else:
                self.stats.observe(num_bytes, time.perf_counter() - t0)
                if load.delete_after:
                    with contextlib.suppress(FileNotFoundError):  # another server removed it first
                        os.remove(load.path)
            self._done.add(load.req_id)

    def _load(self, load: _Load) -> int:
        with open(load.path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise ValueError("not an axon KV file")
            (header_len,) = struct.unpack("<I", f.read(4))
            header = json.loads(f.read(header_len))
            if any(header.get(k) != v for k, v in self.layout.items()):
                raise ValueError(f"its KV (layout, model) {header} is not this server's {self.layout}")
            num_blocks = header["num_blocks"]
            if load.first_block + len(load.block_ids) > num_blocks:
                raise ValueError(
                    f"it holds {num_blocks} blocks, {load.first_block + len(load.block_ids)} needed"
                )
            body = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        ids = torch.tensor(load.block_ids, dtype=torch.long)
        offset, total = 0, 0
        for region in self.regions:
            size = num_blocks * region.shape[1]
            blocks = body[offset : offset + size].view(num_blocks, region.shape[1])
            region.index_copy_(0, ids, blocks[load.first_block : load.first_block + len(load.block_ids)])
            offset += size
            total += len(load.block_ids) * region.shape[1]
        return total

    def wait_for_save(self) -> None:
        meta = self.metadata
        assert isinstance(meta, SharedStorageMetadata)
        for save in meta.saves:
            ids = torch.tensor(save.block_ids, dtype=torch.long)
            header = json.dumps({**self.layout, "num_blocks": len(save.block_ids)}).encode()
            # Written aside and renamed: a reader sees the whole file or none.
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + struct.pack("<I", len(header)) + header)
                for region in self.regions:
                    f.write(region.index_select(0, ids).numpy().data)
            os.replace(tmp, save.path)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput(
            finished_recving=self._done, failed_recving=self._failed, stats=self.stats.take()
        )
        self._done, self._failed = set(), set()
        return out
