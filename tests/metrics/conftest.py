"""Shared fixtures of the metrics tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The stat loggers' monotonic clock, set by the test (``clock[0] = seconds``); starts at 0."""
    now = [0.0]
    monkeypatch.setattr("axon.metrics.loggers.time.monotonic", lambda: now[0])
    return now
