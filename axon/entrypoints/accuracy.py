"""Accuracy debugging: where an axon model's numbers drift from the reference (transformers on the
same weights), keyed by Hugging Face module names. The public API is ``axon.debug``.

    capture(llm, prompts, "model.layers.*")      what each module returns, per prompt
    capture_reference(path, prompts, ...)        the same from transformers (the oracle)
    compare(ours, theirs) -> Comparison          per module: max |diff|, relative, cosine;
                                                 first_divergence: the first one out of tolerance
    replace(llm, prompts, module, tensors)       run with that module's output replaced: does the
                                                 drift start there, or come from upstream?
    validate_logits(llm, prompts, reference)     teacher-forced logits against the reference,
                                                 with a top-k tolerance map
    read_kv / reference_kv                       a prompt's K and V, read back from the paged cache
                                                 through its block table, and transformers'

Names and what they hold (what the Hugging Face module returns, whatever axon fuses):
``model.embed_tokens``; ``model.layers.N`` (the hidden state after the layer's residual add:
axon carries the residual beside the output, so it is ``x + residual``); ``model.layers.N.self_attn``
and ``model.layers.N.mlp`` (before the residual add); ``model.norm``; ``lm_head`` (the logits).
Every forward runs axon's real paged-attention path, eagerly, one prompt at a time (teacher
forced, the prompt's tokens in one step), on a private KV cache. One rank (no tensor
parallelism); decoder models of the Llama family (Llama, Qwen2, Qwen3, Mistral, ...).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from axon.entrypoints.llm import LLM
from axon.forward_context import set_forward_context
from axon.model.layers.attention import Segment, describe_step
from axon.worker.logit_validation import teacher_forced_logits

Prompt = str | Sequence[int]


class Captures(MutableMapping[str, list[torch.Tensor]]):
    """Module name -> one tensor per prompt ([tokens, ...], float32, on the CPU), in forward order."""

    def __init__(self) -> None:
        self._data: dict[str, list[torch.Tensor]] = {}

    def __getitem__(self, key: str) -> list[torch.Tensor]:
        return self._data[key]

    def __setitem__(self, key: str, value: list[torch.Tensor]) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._data.setdefault(name, []).append(tensor.detach().float().cpu())


# ---- axon's side --------------------------------------------------------------------------------


def _as_llm(llm_or_path: LLM | str, dtype: str) -> LLM:
    if isinstance(llm_or_path, LLM):
        return llm_or_path
    return LLM(model=llm_or_path, dtype=dtype, enforce_eager=True)


def _model(llm: LLM) -> nn.Module:
    executor = llm.llm_engine.engine_core.executor
    worker = getattr(executor, "worker", None)
    if worker is None:
        raise ValueError("accuracy debugging runs one rank in this process: tensor_parallel_size must be 1")
    return worker.model


def _token_ids(llm: LLM, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer: give token ids")
        return list(tokenizer.encode(prompt))
    return [int(t) for t in prompt]


def module_names(num_layers: int) -> list[str]:
    """Every name ``capture`` knows, in forward order."""
    names = ["model.embed_tokens"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"model.layers.{i}"]
    return [*names, "model.norm", "lm_head"]


def select(names: Iterable[str], modules: str | Sequence[str]) -> list[str]:
    """The names that ``modules`` (globs such as ``model.layers.*``, or ``re:`` regexes) pick,
    in forward order; a pattern that picks nothing is an error that names it."""
    patterns = [modules] if isinstance(modules, str) else list(modules)
    names = list(names)
    picked: set[str] = set()
    for pattern in patterns:
        if pattern.startswith("re:"):
            found = {n for n in names if re.fullmatch(pattern[3:], n)}
        else:
            # "model.layers.*" means the layers themselves, not their submodules
            found = {
                n for n in names if fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")
            }
        if not found:
            raise ValueError(
                f"no module matches {pattern!r} (modules are named like {names[1]!r}, {names[-2]!r})"
            )
        picked |= found
    return [n for n in names if n in picked]


class _Hooks:
    """Forward hooks on axon's modules that record (or replace) what the HF module of each name
    returns."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = model.model.layers
        self.handles: list[Any] = []

    def modules(self) -> dict[str, tuple[nn.Module, Callable[[Any], torch.Tensor]]]:
        """name -> (axon module, its output -> the HF module's output)."""
        first = lambda out: out[0] if isinstance(out, tuple) else out
        out: dict[str, tuple[nn.Module, Callable[[Any], torch.Tensor]]] = {
            "model.embed_tokens": (self.model.model.embed_tokens, first)
        }
        for i, layer in enumerate(self.layers):
            out[f"model.layers.{i}.self_attn"] = (layer.self_attn, first)
            out[f"model.layers.{i}.mlp"] = (layer.mlp, first)
            out[f"model.layers.{i}"] = (layer, lambda o: o[0] + o[1] if o[1] is not None else o[0])
        out["model.norm"] = (self.model.model.norm, first)
        return out

    def record(self, names: list[str], sink: Callable[[str, torch.Tensor], None]) -> None:
        table = self.modules()
        for name in names:
            if name == "lm_head":
                continue  # the logits, recorded by the caller
            module, view = table[name]
            self.handles.append(module.register_forward_hook(lambda m, a, o, n=name, v=view: sink(n, v(o))))

    def replace(self, name: str, tensor_for: Callable[[], torch.Tensor]) -> None:
        module, _ = self.modules()[name]
        is_layer = re.fullmatch(r"model\.layers\.\d+", name) is not None

        def hook(m: nn.Module, args: Any, out: Any) -> Any:
            new = tensor_for().to(device=(out[0] if isinstance(out, tuple) else out).device)
            if is_layer:  # (x, residual) whose sum is the layer's output: all of it in x
                return new.to(out[0].dtype), torch.zeros_like(out[1])
            if isinstance(out, tuple):
                return (new.to(out[0].dtype), *out[1:])
            return new.to(out.dtype)

        self.handles.append(module.register_forward_hook(hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def capture(
    llm_or_model_path: LLM | str,
    prompts: Sequence[Prompt],
    modules: str | Sequence[str] = "model.layers.*",
    what: str = "output",
    dtype: str = "float32",
    tokens: slice | None = None,
) -> Captures:
    """What each picked module returns for each prompt (teacher forced): ``Captures``, name ->
    one [tokens, ...] tensor per prompt. ``tokens`` keeps a range of positions."""
    if what != "output":
        raise ValueError(
            f"what={what!r}: captures hold modules' outputs (a module's input is the one before it's output)"
        )
    llm = _as_llm(llm_or_model_path, dtype)
    model = _model(llm)
    names = select(module_names(len(model.model.layers)), modules)
    captures = Captures()
    hooks = _Hooks(model)
    hooks.record(names, lambda n, t: captures.add(n, t if tokens is None else t[tokens]))
    try:
        for prompt in prompts:
            logits = teacher_forced_logits(model, _token_ids(llm, prompt))
            if "lm_head" in names:
                captures.add("lm_head", logits if tokens is None else logits[tokens])
    finally:
        hooks.remove()
    return _ordered(captures, names)


def replace(
    llm: LLM, prompts: Sequence[Prompt], module: str, tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The teacher-forced logits of each prompt with ``module``'s output replaced by the prompt's
    tensor (a reference capture of that module): if the drift disappears downstream, it starts
    in that module; if not, it comes from before it."""
    model = _model(llm)
    names = module_names(len(model.model.layers))
    if module not in names or module == "lm_head":
        raise ValueError(f"replace: {module!r} is not a module capture names (e.g. {names[3]!r})")
    if len(tensors) != len(prompts):
        raise ValueError(f"replace: {len(tensors)} tensors for {len(prompts)} prompts")
    current: list[torch.Tensor] = []
    hooks = _Hooks(model)
    hooks.replace(module, lambda: current[0])
    out = []
    try:
        for prompt, tensor in zip(prompts, tensors, strict=True):
            current[:] = [tensor]
            out.append(teacher_forced_logits(model, _token_ids(llm, prompt)).cpu())
    finally:
        hooks.remove()
    return out


def _ordered(captures: Captures, names: list[str]) -> Captures:
    out = Captures()
    for name in names:
        if name in captures:
            out[name] = captures[name]
    return out


# ---- the reference (transformers, float32) --------------------------------------------------------


def reference_model(model_path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def capture_reference(
    model_path: str | nn.Module,
    prompts: Sequence[Prompt],
    modules: str | Sequence[str] = "model.layers.*",
    tokenizer: Any = None,
    tokens: slice | None = None,
) -> Captures:
    """``capture``'s captures from transformers' implementation on the same weights (float32)."""
    model = reference_model(model_path) if isinstance(model_path, str) else model_path
    names = select(module_names(model.config.num_hidden_layers), modules)
    captures = Captures()
    handles = []
    for name in names:
        module = model.get_submodule(name)

        def hook(m: nn.Module, args: Any, out: Any, n: str = name) -> None:
            t = out[0] if isinstance(out, tuple) else out
            t = t[0] if t.dim() == 3 else t  # [1, tokens, ...] -> [tokens, ...]
            captures.add(n, t if tokens is None else t[tokens])

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = _reference_ids(model_path, prompt, tokenizer)
                model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return _ordered(captures, names)


def _reference_ids(model_path: Any, prompt: Prompt, tokenizer: Any) -> list[int]:
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    return list(tokenizer.encode(prompt))


# ---- comparing ----------------------------------------------------------------------------------


@dataclass
class ModuleDiff:
    name: str
    max_abs: float
    max_rel: float  # max |diff| / max |reference|
    cosine: float  # the lowest over prompts, of the flattened tensors
    within: bool


@dataclass
class Comparison:
    rows: list[ModuleDiff] = field(default_factory=list)
    first_divergence: str | None = None  # the first module in forward order outside the tolerance

    def table(self) -> str:
        lines = ["| module | max abs diff | max rel diff | min cosine | within |", "|---|---|---|---|---|"]
        lines += [
            f"| {r.name} | {r.max_abs:.3g} | {r.max_rel:.3g} | {r.cosine:.6f} | {'yes' if r.within else 'NO'} |"
            for r in self.rows
        ]
        return "\n".join(lines)


def compare(a: Captures, b: Captures, atol: float = 1e-4, rtol: float = 1e-4) -> Comparison:
    """Module by module, in ``a``'s order (modules both hold): within when every element has
    ``|a - b| <= atol + rtol * |b|``."""
    result = Comparison()
    for name, ours in a.items():
        if name not in b:
            continue
        theirs = b[name]
        if len(ours) != len(theirs):
            raise ValueError(
                f"compare: {name} has {len(ours)} prompts on one side, {len(theirs)} on the other"
            )
        max_abs = max_rel = 0.0
        cosine = 1.0
        within = True
        for x, y in zip(ours, theirs, strict=True):
            if x.shape != y.shape:
                raise ValueError(f"compare: {name} has shapes {list(x.shape)} and {list(y.shape)}")
            diff = (x - y).abs()
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float(diff.max() / y.abs().max().clamp_min(1e-12)))
            cosine = min(
                cosine, float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))
            )
            within = within and bool((diff <= atol + rtol * y.abs()).all())
        result.rows.append(ModuleDiff(name, max_abs, max_rel, cosine, within))
        if not within and result.first_divergence is None:
            result.first_divergence = name
    return result


# ---- logit validation ---------------------------------------------------------------------------

# The top-k tolerance map: for the reference's k most likely tokens at a position, axon's logits
# may differ by at most atol + rtol * |reference| (looser as k grows: what sampling rarely reaches
# matters less). The default is for float32; bfloat16 engines get the wider one.
FLOAT32_TOLERANCES = {5: (1e-3, 1e-3), 50: (2e-3, 2e-3), 1000: (5e-3, 5e-3), -1: (1e-2, 1e-2)}
BFLOAT16_TOLERANCES = {5: (0.25, 0.05), 50: (0.4, 0.08), 1000: (0.6, 0.1), -1: (1.0, 0.2)}


@dataclass
class PositionCheck:
    prompt: int
    position: int
    passed: bool
    worst: dict[int, float]  # k -> max |diff| among the reference's top-k (-1: all)
    top1_agrees: bool


@dataclass
class LogitValidation:
    checks: list[PositionCheck]
    tolerances: dict[int, tuple[float, float]]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def prompt_passed(self, prompt: int) -> bool:
        return all(c.passed for c in self.checks if c.prompt == prompt)


def validate_logits(
    llm: LLM,
    prompts: Sequence[Prompt],
    reference: str | nn.Module,
    tolerances: dict[int, tuple[float, float]] | None = None,
) -> LogitValidation:
    """Teacher-forced logits of every prompt position against the reference's (transformers,
    float32), through the top-k tolerance map (k -> (atol, rtol); -1: every token)."""
    model = _model(llm)
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    tolerances = tolerances or (FLOAT32_TOLERANCES if dtype == torch.float32 else BFLOAT16_TOLERANCES)
    ref_model = reference_model(reference) if isinstance(reference, str) else reference
    checks = []
    for p, prompt in enumerate(prompts):
        ids = _token_ids(llm, prompt)
        ours = teacher_forced_logits(model, ids).cpu()
        with torch.no_grad():
            theirs = ref_model(torch.tensor([ids])).logits[0].float()
        vocab = min(ours.shape[-1], theirs.shape[-1])
        ours, theirs = ours[:, :vocab], theirs[:, :vocab]
        for pos in range(len(ids)):
            worst, passed = {}, True
            order = theirs[pos].argsort(descending=True)
            for k, (atol, rtol) in sorted(
                tolerances.items(), key=lambda kv: math.inf if kv[0] < 0 else kv[0]
            ):
                idx = order if k < 0 else order[:k]
                diff = (ours[pos, idx] - theirs[pos, idx]).abs()
                worst[k] = float(diff.max())
                passed = passed and bool((diff <= atol + rtol * theirs[pos, idx].abs()).all())
            top1 = bool(ours[pos].argmax() == order[0])
            checks.append(PositionCheck(p, pos, passed, worst, top1))
    return LogitValidation(checks, tolerances)


# ---- KV cache analysis --------------------------------------------------------------------------


@torch.inference_mode()
def read_kv(llm: LLM, prompt: Prompt, block_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prompt's K and V per layer ([tokens, kv_heads, head_dim] each, float32), written by a
    prefill into a paged cache whose blocks are handed out in reverse and read back through the
    block table, as attention reads them."""
    model = _model(llm)
    ids = _token_ids(llm, prompt)
    layers = model.attention_layers()
    arch = model.arch
    param = next(p for p in model.parameters() if p.is_floating_point())
    num_blocks = -(-len(ids) // block_size) + 1
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    block_ids = list(range(num_blocks - 1, 0, -1))
    saved = [(layer.layer_idx, layer.kv_cache) for layer in layers]
    caches = [(torch.zeros(shape, dtype=param.dtype), torch.zeros(shape, dtype=param.dtype)) for _ in layers]
    try:
        for i, layer in enumerate(layers):
            layer.bind_kv_cache(i, caches[i])
        metadata = describe_step([Segment(block_ids, 0, len(ids))], block_size, param.device)
        with set_forward_context(metadata, layers):
            model(torch.tensor(ids), torch.arange(len(ids)))
    finally:
        for layer, (idx, kv) in zip(layers, saved, strict=True):
            layer.layer_idx, layer.kv_cache = idx, kv
    out = []
    positions = torch.arange(len(ids))
    blocks = torch.tensor(block_ids)[positions // block_size]
    offsets = positions % block_size
    for k, v in caches:
        out.append((k[blocks, offsets].float(), v[blocks, offsets].float()))
    return out


def reference_kv(
    model_path: str | nn.Module, prompt: Prompt, tokenizer: Any = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' K and V per layer for the prompt (after rotary, as the cache holds them)."""
    model = reference_model(model_path) if isinstance(model_path, str) else model_path
    ids = _reference_ids(model_path, prompt, tokenizer)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    out = []
    for i in range(model.config.num_hidden_layers):
        layer = cache.layers[i] if hasattr(cache, "layers") else None
        k, v = (layer.keys, layer.values) if layer is not None else cache[i]
        out.append((k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float()))  # [T, heads, dim]
    return out


# ---- the automated pipeline (axon debug accuracy) -------------------------------------------------

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans",
    "Water boils at a temperature of",
]


@dataclass
class AccuracyReport:
    verdict: str
    validation: LogitValidation
    comparison: Comparison
    confirmation: str | None
    html: str


def run_accuracy(
    model: str,
    prompts: Sequence[Prompt] = DEFAULT_PROMPTS,
    dtype: str = "float32",
    atol: float = 2e-3,
    rtol: float = 2e-3,
    progress: Callable[[str], None] = lambda stage: None,
    reference: str | None = None,
) -> AccuracyReport:
    """Logit validation against transformers; then every module captured on both sides and
    compared, to localize the first divergence; then that module's output replaced by the
    reference's, to confirm whether the drift starts there. ``reference``: the folder
    transformers loads (default: the model's own)."""
    llm = LLM(model=model, dtype=dtype, enforce_eager=True)
    path = reference or llm.llm_engine.config.model_config.model_path
    assert path is not None
    progress("loading the reference (transformers, float32)")
    ref = reference_model(path)
    progress("validating logits")
    validation = validate_logits(llm, prompts, ref)
    progress("capturing every module (axon)")
    ours = capture(llm, prompts, "re:.*")
    progress("capturing every module (transformers)")
    theirs = capture_reference(ref, prompts, "re:.*", tokenizer=llm.get_tokenizer())
    if dtype != "float32":  # bfloat16 numbers differ everywhere: compare at its precision
        atol, rtol = max(atol, 5e-2), max(rtol, 5e-2)
    comparison = compare(ours, theirs, atol, rtol)
    confirmation = None
    first = comparison.first_divergence
    if first is not None and first != "lm_head":
        progress(f"replacing {first}'s output with the reference's")
        replaced = replace(llm, prompts, first, theirs[first])
        before = max(
            float((a - b).abs().max()) for a, b in zip(ours["lm_head"], theirs["lm_head"], strict=True)
        )
        after = max(float((a - b).abs().max()) for a, b in zip(replaced, theirs["lm_head"], strict=True))
        where = "starts in" if after < before / 2 else "does not start in"
        confirmation = (
            f"with {first}'s output replaced by the reference's, the logits' max |diff| goes from "
            f"{before:.3g} to {after:.3g}: the drift {where} {first}"
            + ("" if after < before / 2 else " (it comes from upstream, or that module's inputs)")
        )
    n = len(prompts)
    if validation.passed:
        verdict = f"PASS: axon's logits match transformers' on {n} prompts within the top-k tolerance map"
    else:
        failed = sum(not validation.prompt_passed(p) for p in range(n))
        where = f"; first divergence at {first}" if first else ""
        verdict = f"FAIL: {failed} of {n} prompts outside the top-k tolerance map{where}"
    html = _html(verdict, model, dtype, validation, comparison, confirmation, n)
    return AccuracyReport(verdict, validation, comparison, confirmation, html)


def _plot(comparison: Comparison) -> str:
    """The per-module max |diff| (log scale) as a base64 PNG."""
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5))
    values = [max(r.max_abs, 1e-12) for r in comparison.rows]
    colors = ["tab:green" if r.within else "tab:red" for r in comparison.rows]
    ax.bar(range(len(values)), values, color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("max |axon - reference|")
    ax.set_xlabel("module, in forward order")
    step = max(1, len(values) // 20)
    ax.set_xticks(range(0, len(values), step))
    ax.set_xticklabels(
        [comparison.rows[i].name for i in range(0, len(values), step)], rotation=60, ha="right", fontsize=7
    )
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _html(
    verdict: str,
    model: str,
    dtype: str,
    validation: LogitValidation,
    comparison: Comparison,
    confirmation: str | None,
    num_prompts: int,
) -> str:
    from html import escape

    prompt_rows = "".join(
        f"<tr><td>{p}</td><td>{'pass' if validation.prompt_passed(p) else 'FAIL'}</td>"
        f"<td>{sum(c.top1_agrees for c in validation.checks if c.prompt == p)}/"
        f"{sum(1 for c in validation.checks if c.prompt == p)}</td>"
        f"<td>{max(c.worst[min(c.worst)] for c in validation.checks if c.prompt == p):.3g}</td></tr>"
        for p in range(num_prompts)
    )
    module_rows = "".join(
        f'<tr class="{"ok" if r.within else "bad"}"><td>{escape(r.name)}</td><td>{r.max_abs:.3g}</td>'
        f"<td>{r.max_rel:.3g}</td><td>{r.cosine:.6f}</td><td>{'yes' if r.within else 'NO'}</td></tr>"
        for r in comparison.rows
    )
    tolerance = ", ".join(
        f"top-{'all' if k < 0 else k}: {a:g} + {r:g}|ref|" for k, (a, r) in validation.tolerances.items()
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>axon accuracy report</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px}} tr.bad{{background:#fdd}}</style></head><body>
<h1 id="verdict">{escape(verdict)}</h1>
<p>model <code>{escape(model)}</code>, axon in {escape(dtype)} against transformers in float32;
tolerance map: {escape(tolerance)}</p>
<p id="first-divergence">first divergence: <b>{escape(comparison.first_divergence or "none")}</b></p>
<p id="confirmation">{escape(confirmation or "no replacement needed")}</p>
<h2>Logit validation</h2>
<table><tr><th>prompt</th><th>verdict</th><th>top-1 agrees</th><th>worst top-k diff</th></tr>{prompt_rows}</table>
<h2>Per-module divergence</h2>
<img alt="per-module max diff" src="data:image/png;base64,{_plot(comparison)}">
<table id="modules"><tr><th>module</th><th>max abs diff</th><th>max rel diff</th><th>min cosine</th><th>within</th></tr>{module_rows}</table>
</body></html>
"""
