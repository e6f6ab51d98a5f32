"""Profiling with vLLM's surface: ``--profiler-config '{"profiler": "torch", "torch_profiler_dir":
DIR}'`` (or vLLM's older ``VLLM_TORCH_PROFILER_DIR``), then ``POST /start_profile`` and ``POST
/stop_profile`` (``LLM.start_profile()`` / ``stop_profile()`` offline).

Each process of the engine profiles itself with ``torch.profiler`` between start and stop, and
writes one Chrome trace (open it in Perfetto or chrome://tracing) into the folder on stop: the
engine core (with the worker in it), every worker process of a multi-rank executor, and the
API server (the front end: tokenizing, detokenizing, streaming). Steps are named ranges:
``schedule``, ``prepare_inputs``, ``forward <bucket>``, ``sample``, ``update`` in the engine,
``detokenize`` in the front end.

``profiler_config`` keys (vLLM's): ``profiler`` ("torch"), ``torch_profiler_dir``,
``torch_profiler_record_shapes``, ``torch_profiler_with_stack``,
``torch_profiler_with_memory`` (false by default).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

_KEYS = (
    "profiler",
    "torch_profiler_dir",
    "torch_profiler_record_shapes",
    "torch_profiler_with_stack",
    "torch_profiler_with_memory",
)


@dataclass(frozen=True)
class ProfilerSettings:
    folder: str
    record_shapes: bool = False
    with_stack: bool = False
    with_memory: bool = False


def parse_profiler_config(raw: dict[str, Any] | None) -> ProfilerSettings | None:
    """The checked settings; None: profiling is off (the routes answer 404)."""
    if raw is None:
        folder = os.environ.get("VLLM_TORCH_PROFILER_DIR")
        return ProfilerSettings(os.path.abspath(folder)) if folder else None
    if not isinstance(raw, dict):
        raise ValueError(f"profiler_config must be a JSON object, got {raw!r}.")  # noqa: TRY004
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"profiler_config has unknown keys {unknown} (known: {', '.join(_KEYS)})")
    if raw.get("profiler", "torch") != "torch":
        raise ValueError(f"profiler_config.profiler must be 'torch', got {raw.get('profiler')!r}")
    folder = raw.get("torch_profiler_dir")
    if not isinstance(folder, str) or not folder:
        raise ValueError("profiler_config.torch_profiler_dir must name the folder the traces go to")
    flags = {}
    for key in ("record_shapes", "with_stack", "with_memory"):
        value = raw.get(f"torch_profiler_{key}", False)
        if not isinstance(value, bool):
            raise ValueError(  # noqa: TRY004 (a bad option: every option error is a ValueError)
                f"profiler_config.torch_profiler_{key} must be true or false, got {value!r}"
            )
        flags[key] = value
    return ProfilerSettings(os.path.abspath(os.path.expanduser(folder)), **flags)


class Profiler:
    """One process's torch profiler between ``start`` and ``stop``; ``stop`` writes the trace
    ``<folder>/<name>-<time>.pt.trace.json`` and returns its path."""

    def __init__(self, settings: ProfilerSettings, name: str) -> None:
        self.settings = settings
        self.name = name
        self._profile: torch.profiler.profile | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self._profile is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        s = self.settings
        self._profile = torch.profiler.profile(
            activities=activities,
            record_shapes=s.record_shapes,
            with_stack=s.with_stack,
            profile_memory=s.with_memory,
        )
        self._profile.__enter__()

    def stop(self) -> str | None:
        if self._profile is None:
            return None
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        os.makedirs(self.settings.folder, exist_ok=True)
        path = os.path.join(
            self.settings.folder, f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.pt.trace.json"
        )
        profile.export_chrome_trace(path)
        return path
