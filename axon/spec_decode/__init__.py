"""Speculative decoding: proposers (ngram, draft model, EAGLE3), the draft policy, and the
rejection sampler lives in ``axon/sample/rejection.py``."""
