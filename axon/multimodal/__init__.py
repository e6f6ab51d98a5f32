"""Multimodal inputs: images decoded, resized and cut into patches for a vision encoder."""
