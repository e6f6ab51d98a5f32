"""Proposers by method name: the one place a speculative_config becomes a proposer."""

from __future__ import annotations

import torch
from torch import nn

from axon.config import AxonConfig, replace
from axon.model.layers.attention import AttentionBackend
from axon.model.layers.linear import pack_linears
from axon.model.loader import load_hf_config
from axon.model.loader.model_loader import load_model
from axon.spec_decode.config import METHODS, parse_spec_decode_config
from axon.spec_decode.draft_model import DraftModelProposer
from axon.spec_decode.eagle3 import load_eagle3
from axon.spec_decode.eagle3_proposer import Eagle3Proposer
from axon.spec_decode.proposer import NgramProposer, Proposer
from axon.startup import startup_phase


def make_proposer(
    config: AxonConfig,
    target: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    linear_backend: str,
    linear_batch_hint: int,
) -> Proposer | None:
    """The proposer a resolved config asks for (None: speculation is off)."""
    spec = parse_spec_decode_config(config.speculative_config.speculative_config)
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    assert spec.model is not None, "parse_spec_decode_config requires a model for this method"
    if spec.method == "draft_model":
        draft_config = replace(
            config.model_config, model=spec.model, model_path=spec.model, hf_config=load_hf_config(spec.model)
        )
        with startup_phase(f"loading the draft model {spec.model}"):
            draft = load_model(draft_config, dtype, device, backend, linear_backend, linear_batch_hint)
        return DraftModelProposer(draft, config.cache_config.block_size, device)
    if spec.method == "eagle3":
        assert config.model_config.hf_config is not None, "resolve_config() loads the target's config"
        with startup_phase(f"loading the EAGLE3 head {spec.model}"):
            head = load_eagle3(spec.model, config.model_config.hf_config, dtype, device, backend)
            if linear_backend != "torch":
                # Every linear packed as the target's: fc once a step, lm_head on every draft.
                pack_linears(head, linear_backend, linear_batch_hint)
        return Eagle3Proposer(head, target, config.cache_config.block_size, device)
    raise ValueError(
        f"speculative_config.method {spec.method!r} is not supported; supported: {', '.join(METHODS)}"
    )
