"""``axon router``'s configuration, checked once when it is built (from the command line)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from axon.entrypoints.router.policies import POLICIES

_KV_EVENTS_ENDPOINT = re.compile(r"^(tcp://[^*\s]+:\d+|ipc://\S+)$")


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    replica_urls: tuple[str, ...] = ()
    encode_urls: tuple[str, ...] = ()  # encoder servers (--mm-encoder-only): a chat's images first
    policy: str = "round_robin"
    kv_events_endpoints: tuple[str, ...] = ()  # one per routed server (prefill or replica), in order
    block_size: int = 16  # the servers' KV block size, in tokens
    health_interval_s: float = 5.0
    host: str = "0.0.0.0"
    port: int = 8000

    def __post_init__(self) -> None:
        if self.replica_urls and (self.prefill_urls or self.decode_urls):
            raise ValueError("--replica fronts plain servers; it does not go with --prefill/--decode")
        if bool(self.prefill_urls) != bool(self.decode_urls):
            given, missing = ("--prefill", "--decode") if self.prefill_urls else ("--decode", "--prefill")
            raise ValueError(f"{given} needs {missing}: disaggregated serving takes both roles")
        if not (self.replica_urls or self.prefill_urls):
            raise ValueError("no backends: give --replica URL... or --prefill URL... --decode URL...")
        urls = self.prefill_urls + self.decode_urls + self.replica_urls + self.encode_urls
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"backend {twice[0]} is given twice")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r}: supported are {', '.join(POLICIES)}")
        self._check_kv_events()
        if self.block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {self.block_size}")
        if not self.health_interval_s > 0:
            raise ValueError(f"--health-interval must be above 0 seconds, got {self.health_interval_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port")

    def _check_kv_events(self) -> None:
        if self.policy == "prefix" and not self.kv_events_endpoints:
            raise ValueError("--policy prefix needs --kv-events: each routed server's KV events endpoint")
        if self.kv_events_endpoints and self.policy != "prefix":
            raise ValueError(f"--kv-events is read by --policy prefix only (the policy is {self.policy})")
        routed = self.prefill_urls or self.replica_urls
        if self.kv_events_endpoints and len(self.kv_events_endpoints) != len(routed):
            flag = "--prefill" if self.prefill_urls else "--replica"
            raise ValueError(
                f"--kv-events takes one endpoint per {flag} server, in the same order: got "
                f"{len(self.kv_events_endpoints)} endpoints for {len(routed)} servers"
            )
        for endpoint in self.kv_events_endpoints:
            if not _KV_EVENTS_ENDPOINT.match(endpoint):
                raise ValueError(
                    f"--kv-events {endpoint!r}: give where the router connects, tcp://HOST:PORT "
                    "(the server's host, not *) or ipc://PATH"
                )

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_urls)


def backend_url(text: str) -> str:
    """``http://host:port`` from what a user types: ``host:port`` or a URL without a path."""
    url = text if "://" in text else f"http://{text}"
    scheme, _, rest = url.partition("://")
    host, _, path = rest.partition("/")
    if scheme not in ("http", "https") or not host or path.strip("/"):
        raise ValueError(f"backend {text!r}: give the server's root URL, e.g. http://host:8000 (no /v1)")
    return f"{scheme}://{host}"
