"""Encoder disaggregation (vLLM's EC transfer, ``--ec-transfer-config``): an encoder server
computes images' vision features and a prefill/decode server loads them instead of running its
own vision tower.

    router                     encoder server (ec_producer,          prefill/decode server
                               --mm-encoder-only)                     (ec_consumer)
    each image of a chat  ───> features by image digest ──save──> <path>/<digest>.ec
    the whole chat  ───────────────────────────────────────────────> a new request's images:
                                                                      loaded by digest if there,
                                                                      else encoded here

An image's digest (axon/multimodal/image.py) hashes its patches and grid, so both servers name
the same picture the same way whatever the text around it. The transport is a shared folder
(vLLM's ``ECExampleConnector``, formerly ``ECSharedStorageConnector``): a file is written
under a temporary name and renamed, so a reader sees all of it or nothing. A file that is
missing, unreadable or of the wrong shape is a miss: the consumer encodes the image itself.

    <shared_storage_path>/<digest>.ec   safetensors: "embeds" [tokens, hidden], "deepstack.K"

``ec_connector_extra_config``: ``shared_storage_path`` (vLLM's key; default /dev/shm/axon-ec),
``ttl_seconds`` (a producer deletes files older than this; default 600).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from axon.kv_transfer.config import check_keys

logger = logging.getLogger(__name__)

# vLLM's connector name and its earlier one; both are this shared-folder transport.
CONNECTORS = ("ECExampleConnector", "ECSharedStorageConnector")
ROLES = ("ec_producer", "ec_consumer", "ec_both")
_KEYS = ["ec_connector", "ec_role", "ec_connector_extra_config"]
_IGNORED_KEYS = {
    "engine_id",
    "ec_buffer_device",
    "ec_buffer_size",
    "ec_ip",
    "ec_port",
    "ec_connector_module_path",
}
DEFAULT_PATH = "/dev/shm/axon-ec"
DEFAULT_TTL_S = 600.0
_SUFFIX = ".ec"
_SWEEP_INTERVAL_S = 10.0


@dataclass(frozen=True)
class ECTransferSettings:
    ec_connector: str
    ec_role: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")


def parse_ec_transfer_config(raw: dict[str, Any] | None) -> ECTransferSettings | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"ec_transfer_config must be a JSON object, got {raw!r}.")  # noqa: TRY004
    check_keys("ec_transfer_config", raw, _KEYS, ignored=_IGNORED_KEYS)
    connector = raw.get("ec_connector")
    if connector not in CONNECTORS:
        raise ValueError(
            f"ec_transfer_config.ec_connector must be one of {', '.join(CONNECTORS)}, got {connector!r}."
        )
    role = raw.get("ec_role")
    if role not in ROLES:
        raise ValueError(f"ec_transfer_config.ec_role must be one of {', '.join(ROLES)}, got {role!r}.")
    extra = raw.get("ec_connector_extra_config")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError(  # noqa: TRY004
            f"ec_transfer_config.ec_connector_extra_config must be a JSON object, got {extra!r}."
        )
    path = extra.get("shared_storage_path", DEFAULT_PATH)
    if not (isinstance(path, str) and path):
        raise ValueError(
            f"ec_transfer_config.ec_connector_extra_config.shared_storage_path must be a folder, got {path!r}."
        )
    ttl = extra.get("ttl_seconds", DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise ValueError(
            f"ec_transfer_config.ec_connector_extra_config.ttl_seconds must be a number above 0, got {ttl!r}."
        )
    return ECTransferSettings(connector, role, dict(extra))


Features = tuple[torch.Tensor, list[torch.Tensor]]  # an image's embeds and deepstack features


class ECSharedStorageConnector:
    """Save (producer) and load (consumer) images' features by digest in a shared folder."""

    def __init__(self, settings: ECTransferSettings) -> None:
        self.settings = settings
        self.root = str(settings.extra.get("shared_storage_path", DEFAULT_PATH))
        self.ttl_s = float(settings.extra.get("ttl_seconds", DEFAULT_TTL_S))
        os.makedirs(self.root, exist_ok=True)
        self._last_sweep = 0.0
        self.num_saved = self.num_loaded = self.num_load_failures = 0

    def path_for(self, digest: str) -> str:
        if not digest.isalnum():
            raise ValueError(f"an image digest is hexadecimal, got {digest!r}")
        return os.path.join(self.root, digest + _SUFFIX)

    def has(self, digest: str) -> bool:
        return os.path.exists(self.path_for(digest))

    def save(self, digest: str, embeds: torch.Tensor, deepstack: list[torch.Tensor]) -> None:
        tensors = {"embeds": embeds.contiguous().cpu()}
        tensors.update({f"deepstack.{k}": d.contiguous().cpu() for k, d in enumerate(deepstack)})
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".writing-", suffix=_SUFFIX)
        os.close(fd)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, self.path_for(digest))  # readers see the whole file or none
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.num_saved += 1
        self._sweep()

    def load(
        self,
        digest: str,
        num_tokens: int,
        hidden: int,
        num_deepstack: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Features | None:
        """The image's features if a file holds them in the expected shape, else None (and a log
        line when a file was there but unusable): the caller encodes the image itself."""
        path = self.path_for(digest)
        if not os.path.exists(path):
            return None
        try:
            tensors = load_file(path)
            embeds = tensors["embeds"]
            deepstack = [tensors[f"deepstack.{k}"] for k in range(num_deepstack)]
            want = (num_tokens, hidden)
            if tuple(embeds.shape) != want or any(tuple(d.shape) != want for d in deepstack):
                raise ValueError(f"features of shape {tuple(embeds.shape)}, expected {want}")
        except Exception as e:  # noqa: BLE001 (any unreadable file is a miss, not a failed request)
            self.num_load_failures += 1
            logger.warning("encoder cache file %s unusable (%s): the image is encoded here", path, e)
            return None
        self.num_loaded += 1
        return embeds.to(device, dtype), [d.to(device, dtype) for d in deepstack]

    def _sweep(self) -> None:
        """Delete files older than the TTL (a producer's, at most every few seconds)."""
        now = time.time()
        if now - self._last_sweep < _SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.endswith(_SUFFIX):
                    with contextlib.suppress(OSError):
                        if now - entry.stat().st_mtime > self.ttl_s:
                            os.unlink(entry.path)


def make_ec_connector(raw: dict[str, Any] | None) -> ECSharedStorageConnector | None:
    settings = parse_ec_transfer_config(raw)
    return None if settings is None else ECSharedStorageConnector(settings)
