"""The OpenAI-compatible HTTP server (``axon serve``), laid out as vLLM's ``entrypoints/openai``."""
