"""``speculative_config``: vLLM's keys, checked at start-up, resolved once into ``SpecDecodeConfig``.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}
    {"method": "eagle3", "model": "/path/to/eagle3-head", "num_speculative_tokens": 3}

vLLM's rules: ``method`` may be left out when ``model`` is given (an EAGLE3 checkpoint is known by
its architecture, anything else is a draft model); ngram's lookup bounds default to 5 and 5, and
one given bound sets the other. ``disable_by_batch_size`` (vLLM's key) turns speculation off
while more requests than that run. axon's own key ``adaptive`` (default true) picks the number of
drafts per step from measured acceptance and the batch (``axon/spec_decode/policy.py``).
Errors name the field, as ``speculative_config.<key>``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3")
_ALIASES = {"[ngram]": "ngram", "draft": "draft_model"}
_KNOWN_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "adaptive",
    "draft_tensor_parallel_size",
}
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class SpecDecodeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model or EAGLE3 head folder
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The resolved options, in vLLM's keys (what resolve_config stores back in the tree)."""
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "adaptive": self.adaptive,
        }
        if self.model is not None:
            out["model"] = self.model
        if self.method == "ngram":
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        return out


def _fail(key: str, why: str) -> ValueError:
    return ValueError(f"speculative_config.{key} {why}")


MAX_SPECULATIVE_TOKENS = 16  # also bounds the per-position metric series


def _positive_int(options: dict[str, Any], key: str, required: bool = False) -> int | None:
    value = options.get(key)
    if value is None:
        if required:
            raise _fail(key, "is required (the number of tokens drafted per step, at least 1)")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(key, f"must be an integer of at least 1, got {value!r}")
    return value


def parse_spec_decode_config(options: dict[str, Any] | None) -> SpecDecodeConfig | None:
    """The checked options (no model is read here but a draft's config.json); None when off."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {options!r}")  # noqa: TRY004
    unknown = sorted(set(options) - _KNOWN_KEYS)
    if unknown:
        raise _fail(unknown[0], f"is not a supported key; supported: {', '.join(sorted(_KNOWN_KEYS))}")
    k = _positive_int(options, "num_speculative_tokens", required=True)
    assert k is not None
    if k > MAX_SPECULATIVE_TOKENS:
        raise _fail(
            "num_speculative_tokens",
            f"must be at most {MAX_SPECULATIVE_TOKENS}, got {k} (acceptance of a draft position "
            "falls geometrically: past a few tokens each extra draft is verified work that is rejected)",
        )
    model = options.get("model")
    if model is not None and not isinstance(model, str):
        raise _fail("model", f"must be a path, got {model!r}")
    method = _method(options.get("method"), model)
    if method != "ngram" and model is None:
        raise _fail("model", f"is required for method {method!r} (the draft's folder)")
    if method == "ngram" and model is not None:
        raise _fail("model", "does not apply to method 'ngram' (it drafts from the request's own tokens)")
    if model is not None and not os.path.exists(os.path.expanduser(model)):
        raise _fail("model", f"{model!r} does not exist (a local folder or .gguf file; axon never downloads)")
    lo = _positive_int(options, "prompt_lookup_min")
    hi = _positive_int(options, "prompt_lookup_max")
    lo, hi = (lo or hi or 5), (hi or lo or 5)
    if lo > hi:
        raise _fail("prompt_lookup_min", f"{lo} exceeds prompt_lookup_max {hi}")
    tp = options.get("draft_tensor_parallel_size")
    if tp not in (None, 1) or isinstance(tp, bool):  # None: vLLM's default (the target's, here 1)
        raise _fail("draft_tensor_parallel_size", f"must be 1 (the draft runs beside the target), got {tp!r}")
    adaptive = options.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise _fail("adaptive", f"must be true or false, got {adaptive!r}")
    return SpecDecodeConfig(
        method=method,
        num_speculative_tokens=k,
        model=None if model is None else os.path.expanduser(model),
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        disable_by_batch_size=_positive_int(options, "disable_by_batch_size"),
        adaptive=adaptive,
    )


def _method(method: Any, model: str | None) -> str:
    if method is None:
        if model is None:
            raise _fail("method", f"is required without a model; one of {', '.join(METHODS)}")
        if os.path.isfile(os.path.expanduser(model)):
            return "draft_model"  # a .gguf file
        return "eagle3" if _architectures(model) & set(EAGLE3_ARCHITECTURES) else "draft_model"
    if not isinstance(method, str):
        raise _fail("method", f"must be a string, one of {', '.join(METHODS)}; got {method!r}")
    method = _ALIASES.get(method, method)
    if method not in METHODS:
        raise _fail("method", f"{method!r} is not supported; supported: {', '.join(METHODS)}")
    return method


def _architectures(model: str) -> set[str]:
    return set(read_draft_config(model).get("architectures") or ())


def read_draft_config(model: str) -> dict[str, Any]:
    """The draft folder's config.json; errors name ``speculative_config.model``."""
    path = os.path.join(os.path.expanduser(model), "config.json")
    if not os.path.isfile(path):
        raise _fail("model", f"{model!r} is not a model folder with a config.json")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise _fail("model", f"{path} is not valid JSON: {e}") from None


def check_draft_model(spec: SpecDecodeConfig, target_hf_config: dict[str, Any]) -> None:
    """A draft model must share the target's vocabulary (its tokens are the target's ids)."""
    assert spec.model is not None
    draft = read_draft_config(spec.model)
    if set(draft.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
        raise _fail("model", f"{spec.model!r} is an EAGLE3 head; use method 'eagle3'")
    if draft.get("vocab_size") != target_hf_config.get("vocab_size"):
        raise _fail(
            "model",
            f"{spec.model!r} has vocab_size {draft.get('vocab_size')}, the target "
            f"{target_hf_config.get('vocab_size')}: a draft model needs the target's tokenizer",
        )
