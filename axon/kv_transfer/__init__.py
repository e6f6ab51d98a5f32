"""KV transfer: what leaves the engine about its KV cache (connectors, KV cache events)."""
