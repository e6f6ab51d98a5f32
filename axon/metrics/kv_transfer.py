"""KV connector metrics (disaggregated serving), with vLLM's NIXL names.

The worker half counts its transfers (``SchedulerStats.kv_transfer``: counts since its previous
report, None when nothing moved). NixlConnector's are vLLM's::

  vllm:nixl_xfer_time_seconds        histogram of one transfer's duration (READ posted to done)
  vllm:nixl_bytes_transferred        histogram of one transfer's bytes (_count: transfers)
  vllm:nixl_num_failed_transfers     counter of loads that failed (the prompt is recomputed)
  vllm:nixl_num_kv_expired_reqs      counter of prefill-side requests whose blocks no decode
                                     server read in VLLM_NIXL_ABORT_REQUEST_TIMEOUT

SharedStorageConnector's are the same four with ``shared_storage`` for ``nixl``. They exist on
``/metrics`` only when a connector is configured.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from axon.metrics.labels import per_engine
from axon.step_outputs import KVTransferStats

_PREFIXES = {"NixlConnector": "nixl", "SharedStorageConnector": "shared_storage"}
_SECONDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_BYTES = [2**k for k in range(14, 34, 2)]  # 16 KiB .. 8 GiB


class KVTransferProm:
    def __init__(
        self,
        registry: CollectorRegistry,
        labelnames: list[str],
        labelvalues: Mapping[int, list[str]],
        connector: str,
    ) -> None:
        p = f"vllm:{_PREFIXES[connector]}"

        def metric(kind: type, name: str, doc: str, **kw: object) -> dict:
            return per_engine(kind(name, doc, labelnames, registry=registry, **kw), labelvalues)

        self.xfer_time = metric(
            Histogram, f"{p}_xfer_time_seconds", "KV transfer durations.", buckets=_SECONDS
        )
        self.bytes = metric(Histogram, f"{p}_bytes_transferred", "Bytes per KV transfer.", buckets=_BYTES)
        self.failed = metric(Counter, f"{p}_num_failed_transfers", "Failed KV transfers.")
        self.expired = metric(
            Counter, f"{p}_num_kv_expired_reqs", "Requests whose KV no decode server read in time."
        )

    def record(self, stats: KVTransferStats, engine_idx: int = 0) -> None:
        for seconds, num_bytes in zip(stats.seconds, stats.bytes_per_transfer, strict=True):
            self.xfer_time[engine_idx].observe(seconds)
            self.bytes[engine_idx].observe(num_bytes)
        self.failed[engine_idx].inc(stats.num_failed_transfers)
        self.expired[engine_idx].inc(stats.num_expired)
