"""Imports go down the layer list of DESIGN.md ("Layers"), never up, and core/ imports no torch.

Every module under axon/ is parsed with ``ast``; every import counts, wherever it is written (module
level, inside a function, under ``TYPE_CHECKING``), in every form (``import axon.x``,
``from axon.x import y``, ``from axon import x``, relative imports).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

AXON = Path(__file__).resolve().parents[1] / "axon"

# Top first; a module may import its own layer and any layer after it. DESIGN.md's list, in its
# order, then the places DESIGN does not list, each with its reason.
LAYERS: tuple[str, ...] = (
    "__init__",  # axon/__init__.py: the public API re-exports LLM (entrypoints), so it is the top
    # The accuracy-debugging API (axon.debug: capture, compare, replace, logit validation) drives
    # whole engines and transformers' models: it sits above entrypoints, whose CLI reaches it
    # through entrypoints/accuracy.py (the implementation), which it re-exports.
    "debug",
    "entrypoints",
    "engine",
    "core",
    "executor",
    "worker",
    # Proposers run draft models (EAGLE3 heads, small models) through the model layer's attention,
    # so speculative decoding sits above the model, not beside sampling as DESIGN drew it.
    "spec_decode",
    "model",
    "sample",
    "structured_output",
    "kv_transfer",
    "metrics",
    # Images for multimodal models (processing, prompt expansion, the records sent to the
    # worker): read by engine (input processing), entrypoints (chat) and worker.
    "multimodal",
    # Process groups and collectives: read by model layers (sharding), worker and executor.
    "distributed",
    "platforms",
    # DESIGN's top-level modules, in its order: the shared records every layer may build. The
    # step records are among them: DESIGN drew scheduler_output.py inside core/, yet executor,
    # worker, sample and metrics (below core) read them, so they sit here, below every reader.
    "config",
    "step_outputs",  # what the engine core reports per step: EngineCoreOutput, SchedulerStats
    "scheduler_output",  # scheduler <-> worker: SchedulerOutput, ModelRunnerOutput
    "sampling_params",
    "lora",  # LoRARequest and the record requests carry: imports nothing from axon
    "pooling_params",
    "outputs",
    # Not in DESIGN's list; each imports nothing from axon, so it sits at the bottom:
    "reasoning",  # text rules of <think> markers, read by entrypoints and structured_output
    "forward_context",  # the per-step channel from the runner (worker) to the layers (model)
    "startup",  # start-up phase timing, logged by engine, model loaders and platforms
    "version",  # the release string, for the API and the worker's compile-cache key
    "csrc",  # C++ sources (no Python), built by platforms/cpu_kernels.py
)
RANK = {name: i for i, name in enumerate(LAYERS)}


def _module_name(path: Path) -> str:
    parts = path.relative_to(AXON.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "axon", module
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute axon module) for every import of axon in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "axon")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.split(".")[0] != "axon":
                continue
            if source == "axon":  # `from axon import x`: x is a layer (or a name of the API)
                yield from ((node.lineno, f"axon.{a.name}") for a in node.names)
            else:
                yield node.lineno, source


def _modules() -> list[Path]:
    return sorted(AXON.rglob("*.py"))


def _upward_imports() -> dict[tuple[str, str], str]:
    """(module, imported module) -> a message naming both layers, for every import that goes up."""
    found = {}
    for path in _modules():
        module = _module_name(path)
        own = _layer(module)
        for line, target in _imports(path):
            layer = _layer(target)
            if layer not in RANK and f"axon.{layer}" != target:
                continue  # `from axon import SamplingParams`: a name, not a module
            if RANK.get(layer, -1) < RANK[own]:
                message = f"{module}:{line} imports {target}: layer {own!r} imports {layer!r}, above it"
                found[(module, target)] = message
    return found


def test_every_module_has_a_layer() -> None:
    unknown = {
        f"{path.relative_to(AXON.parent)} ({_layer(_module_name(path))})"
        for path in _modules()
        if _layer(_module_name(path)) not in RANK
    }
    assert not unknown, f"place these in LAYERS with a reason: {sorted(unknown)}"
    folders = {p.name for p in AXON.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= set(RANK), sorted(folders - set(RANK))


def test_imports_go_down_the_layer_list() -> None:
    found = _upward_imports()
    violations = [message for _, message in sorted(found.items())]
    assert not violations, "\n".join(violations)


def test_core_imports_no_torch() -> None:
    offenders = [
        f"{path.relative_to(AXON.parent)}:{node.lineno}"
        for path in sorted((AXON / "core").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch")
    ]
    assert not offenders, f"core/ is pure Python: {offenders}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from axon.engine.tokenizer import get_tokenizer\n", ["axon.engine.tokenizer"]),
        ("def f():\n    import axon.engine.core\n", ["axon.engine.core"]),
        ("from axon import engine, config\n", ["axon.engine", "axon.config"]),
        ("from ..engine import tokenizer\n", ["axon.engine"]),
        ("from . import buckets\n", ["axon.worker"]),
        ("import torch\nfrom typing import Any\n", []),
    ],
)
def test_the_parser_sees_every_form(tmp_path: Path, source: str, expected: list[str], monkeypatch) -> None:
    """The checker itself: a module at axon/worker/x.py with ``source`` imports ``expected``."""
    root = tmp_path / "axon"
    (root / "worker").mkdir(parents=True)
    path = root / "worker" / "x.py"
    path.write_text(source)
    monkeypatch.setattr(f"{__name__}.AXON", root)
    assert [target for _, target in _imports(path)] == expected
