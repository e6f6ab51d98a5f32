"""The connector named by ``kv_transfer_config.kv_connector``, one half per role."""

from __future__ import annotations

from axon.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from axon.kv_transfer.config import KVTransferSettings


def make_scheduler_connector(
    settings: KVTransferSettings, block_size: int, engine_index: int
) -> KVConnectorScheduler:
    if settings.kv_connector == "NixlConnector":
        from axon.kv_transfer.nixl_connector import NixlConnectorScheduler

        return NixlConnectorScheduler(settings, block_size, engine_index)
    from axon.kv_transfer.shared_storage_connector import SharedStorageConnectorScheduler

    return SharedStorageConnectorScheduler(settings, block_size, engine_index)


def make_worker_connector(
    settings: KVTransferSettings, block_size: int, engine_index: int
) -> KVConnectorWorker:
    if settings.kv_connector == "NixlConnector":
        from axon.kv_transfer.nixl_connector import NixlConnectorWorker

        return NixlConnectorWorker(settings, block_size, engine_index)
    from axon.kv_transfer.shared_storage_connector import SharedStorageConnectorWorker

    return SharedStorageConnectorWorker(settings, block_size, engine_index)
