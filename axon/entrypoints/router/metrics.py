"""``axon router``'s own Prometheus metrics (``axon_router:`` names), in their own registry."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from axon.entrypoints.router.policies import Backend


class RouterMetrics:
    """The router's own Prometheus metrics, in their own registry (never the process-global one)."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.registry = r = CollectorRegistry()
        per_backend = ["backend", "role"]
        self.requests = Counter(
            "axon_router:requests", "Requests sent to a backend (every try).", per_backend, registry=r
        )
        self.failures = Counter(
            "axon_router:backend_failures",
            "Tries a backend failed: refused, died or a 5xx.",
            per_backend,
            registry=r,
        )
        self.in_flight = Gauge(
            "axon_router:requests_in_flight", "Requests open at a backend.", per_backend, registry=r
        )
        self.up = Gauge(
            "axon_router:backend_up", "1 while the backend counts as up.", per_backend, registry=r
        )
        self.retries = Counter(
            "axon_router:retries",
            "Requests passed to another backend of the role after a failure.",
            ["role"],
            registry=r,
        )
        self.fallbacks = Counter(
            "axon_router:fallbacks",
            "Disaggregated requests no prefill server took: the decode server computed the prompt.",
            registry=r,
        )
        self.encoder_fallbacks = Counter(
            "axon_router:encoder_fallbacks",
            "Images no encoder server took: the prefill/decode (or replica) server encoded them.",
            registry=r,
        )
        self.unserved = Counter(
            "axon_router:unserved_requests",
            "Requests no backend answered, or whose stream broke off.",
            registry=r,
        )
        self.latency = Histogram(
            "axon_router:request_latency_seconds",
            "From a request's arrival to the end of its answer.",
            ["endpoint"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0),
            registry=r,
        )
        for b in backends:
            for family in (self.requests, self.failures, self.in_flight, self.retries):
                family.labels(*((b.url, b.role) if family is not self.retries else (b.role,)))
            self.up.labels(b.url, b.role).set(1 if b.up else 0)

    def add_prefix_metrics(
        self, backends: Sequence[Backend], num_cached_blocks: Callable[[int], int]
    ) -> None:
        """The prefix policy's: what it matched, and what each routed server holds
        (``num_cached_blocks(backend.index)``, read at each scrape)."""
        r = self.registry
        self.prefix_queried = Counter(
            "axon_router:prefix_queried_tokens", "Prompt tokens routed by the prefix policy.", registry=r
        )
        self.prefix_matched = Counter(
            "axon_router:prefix_matched_tokens",
            "Prompt tokens the chosen server holds as a cached prefix (from its KV events).",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "axon_router:prefix_hit_rate",
            "prefix_matched_tokens / prefix_queried_tokens, since start.",
            registry=r,
        )
        cached = Gauge(
            "axon_router:prefix_cached_blocks",
            "Blocks a server holds in its prefix cache, from its KV events.",
            ["backend", "role"],
            registry=r,
        )
        for b in backends:
            cached.labels(b.url, b.role).set_function(lambda i=b.index: num_cached_blocks(i))
        self._queried = self._matched = 0

    def observe_prefix_match(self, num_prompt_tokens: int, num_matched_tokens: int) -> None:
        self._queried += num_prompt_tokens
        self._matched += num_matched_tokens
        self.prefix_queried.inc(num_prompt_tokens)
        self.prefix_matched.inc(num_matched_tokens)
        self.prefix_hit_rate.set(self._matched / self._queried if self._queried else 0.0)
