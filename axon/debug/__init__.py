"""Accuracy debugging, keyed by Hugging Face module names (``model.layers.3.mlp``,
``model.norm``, ``lm_head``): capture what each module returns, the same from transformers,
compare them to find the first module that drifts, replace a module's output to confirm it,
validate teacher-forced logits with a top-k tolerance map, and read a prompt's K and V back
from the paged cache. See axon/entrypoints/accuracy.py; ``axon debug accuracy`` runs the whole
pipeline into an HTML report.
"""

from axon.entrypoints.accuracy import (
    Captures,
    Comparison,
    LogitValidation,
    capture,
    capture_reference,
    compare,
    read_kv,
    reference_kv,
    replace,
    run_accuracy,
    validate_logits,
)

__all__ = [
    "Captures",
    "Comparison",
    "LogitValidation",
    "capture",
    "capture_reference",
    "compare",
    "read_kv",
    "reference_kv",
    "replace",
    "run_accuracy",
    "validate_logits",
]
