"""One labelled series per engine core, as vLLM's ``make_per_engine`` builds them.

Every axon metric carries ``model_name`` and ``engine`` (the engine core's index, ``"0"`` ..
``"N-1"`` with ``--data-parallel-size N``); a metric family is made once per registry and each
engine gets its own child series, present (at 0) from the first scrape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LABELNAMES = ["model_name", "engine"]


def engine_labelvalues(model_name: str, engine_indexes: list[int]) -> dict[int, list[str]]:
    """engine index -> its values of ``LABELNAMES``."""
    return {i: [model_name, str(i)] for i in engine_indexes}


def per_engine(metric: Any, labelvalues: Mapping[int, list[str]]) -> dict[int, Any]:
    """engine index -> ``metric``'s child series for that engine."""
    return {i: metric.labels(*values) for i, values in labelvalues.items()}
