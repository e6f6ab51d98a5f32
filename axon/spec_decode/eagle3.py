"""EAGLE3 draft heads in the public checkpoint format (the one vLLM and SGLang load).

A head is a folder:

    config.json        architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1, the head's Llama
                       keys (hidden_size, intermediate_size, num_attention_heads, ...), vocab_size (the
                       target's), draft_vocab_size, target_hidden_size (default: hidden_size),
                       eagle_config.eagle_aux_hidden_state_layer_ids (default: default_aux_layers)
    model.safetensors  fc.weight                     [hidden, 3 * target_hidden]
                       midlayer.input_layernorm.weight, midlayer.hidden_norm.weight,
                       midlayer.post_attention_layernorm.weight     [hidden]
                       midlayer.self_attn.{q,k,v}_proj.weight       [heads * head_dim, 2 * hidden]
                       midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
                       norm.weight [hidden]; lm_head.weight [draft_vocab, hidden]
                       d2t [draft_vocab] int64: target_id = draft_id + d2t[draft_id]
                       t2d [vocab] bool: which target ids the draft vocabulary holds

Names may carry a ``model.`` prefix. The token embedding is the target's (``share_embeddings``);
a checkpoint that stores its own ``embed_tokens.weight`` keeps it unless it equals the target's.

One draft step over T tokens (vLLM's ``llama_eagle3``), with ``hidden`` either ``fc`` of the
target's aux hidden states (the first step) or the previous step's output:

    residual = hidden
    h = cat(input_layernorm(embed(token)), hidden_norm(hidden))     [T, 2 * hidden]
    h = self_attn(h)                  q/k/v from 2 * hidden, rotary on positions, paged KV cache
    h, residual = post_attention_layernorm(h, residual)             add, then norm
    out = mlp(h) + residual           [T, hidden], fed back as the next step's hidden
    logits = lm_head(norm(out))       [T, draft_vocab]

``forward`` runs the step through axon's paged ``Attention`` (the engine's KV cache and block
tables); ``forward_dense`` runs the same weights with dense causal attention over [B, L] batches,
for training, in plain torch (axon's CPU kernels have no backward).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from axon.model.layers.attention import AttentionBackend
from axon.model.layers.attention.layer import Attention
from axon.model.layers.linear import MergedLinear
from axon.model.layers.norm import RMSNorm
from axon.model.layers.rotary import RotaryEmbedding
from axon.model.loader.model_loader import build_empty
from axon.model.loader.safetensors_loader import iterate_safetensors
from axon.model.models.llama import STACKED_PARAMS, DecoderArch, LlamaAttention, LlamaMLP, default_aux_layers
from axon.model.models.weights import load_by_name
from axon.spec_decode.config import EAGLE3_ARCHITECTURES

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"
_REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "draft_vocab_size",
)
# Merged layers written back as the checkpoint's separate projections: merged -> shard names.
_UNSTACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fail(path: str, why: str) -> ValueError:
    return ValueError(f"speculative_config.model: EAGLE3 head {path}: {why}")


@dataclass(frozen=True)
class Eagle3Config:
    """A head's config.json, checked against its target."""

    arch: DecoderArch  # the midlayer's shapes; vocab_size is the target's
    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    # Some heads norm the hidden state before it joins the residual stream (vLLM's option).
    norm_before_residual: bool = False


def check_eagle3_config(path: str, target_hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The head's config.json, checked against the target's config; errors name the field."""
    config = _read_config(path)
    parse_eagle3_config(config, target_hf_config, path)
    return config


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(file):
        raise _fail(path, "is not a folder with a config.json")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise _fail(path, f"config.json holds a JSON {type(config).__name__}, expected an object")
    return config


def parse_eagle3_config(
    config: Mapping[str, Any], target_hf_config: Mapping[str, Any], path: str = "<config>"
) -> Eagle3Config:
    """``config`` (a head's config.json) as an ``Eagle3Config``; ValueError naming the field."""
    archs = config.get("architectures") or []
    if not set(archs) & set(EAGLE3_ARCHITECTURES):
        raise _fail(
            path, f"architectures {archs!r} name no EAGLE3 head; expected {EAGLE3_ARCHITECTURES[0]!r}"
        )
    missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
    if missing:
        raise _fail(path, f"config.json lacks {missing[0]}")
    if config["num_hidden_layers"] != 1:
        raise _fail(
            path, f"num_hidden_layers {config['num_hidden_layers']}: only one-layer heads are supported"
        )
    _check_matches_target(config, target_hf_config, path)
    try:
        arch = DecoderArch.from_hf(dict(config))
    except (KeyError, ValueError) as e:
        raise _fail(path, str(e)) from None
    draft_vocab, vocab = config["draft_vocab_size"], config["vocab_size"]
    if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab:
        raise _fail(path, f"draft_vocab_size {draft_vocab!r} is not between 1 and vocab_size {vocab}")
    return Eagle3Config(
        arch=arch,
        target_hidden_size=int(config.get("target_hidden_size") or config["hidden_size"]),
        draft_vocab_size=draft_vocab,
        aux_layer_ids=_aux_layer_ids(config, int(target_hf_config["num_hidden_layers"]), path),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
    )


def _check_matches_target(config: Mapping[str, Any], target: Mapping[str, Any], path: str) -> None:
    if config["vocab_size"] != target["vocab_size"]:
        raise _fail(
            path,
            f"vocab_size {config['vocab_size']} differs from the target's vocab_size {target['vocab_size']}",
        )
    target_hidden = config.get("target_hidden_size")
    field = "target_hidden_size" if target_hidden is not None else "hidden_size (no target_hidden_size)"
    if (target_hidden or config["hidden_size"]) != target["hidden_size"]:
        raise _fail(
            path,
            f"{field} {target_hidden or config['hidden_size']} differs from the target's hidden_size "
            f"{target['hidden_size']}",
        )
    if config["hidden_size"] != target["hidden_size"]:
        # The head embeds its tokens with the target's embedding.
        raise _fail(
            path,
            f"hidden_size {config['hidden_size']} differs from the target's hidden_size "
            f"{target['hidden_size']}, whose token embeddings the head reads",
        )


def _aux_layer_ids(config: Mapping[str, Any], num_target_layers: int, path: str) -> tuple[int, ...]:
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layers(num_target_layers)
    if not isinstance(ids, list) or not ids:
        raise _fail(path, f"eagle_config.eagle_aux_hidden_state_layer_ids {ids!r} is not a list of layer ids")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_target_layers:
            raise _fail(
                path,
                f"eagle_config.eagle_aux_hidden_state_layer_ids holds {i!r}, not a layer of the target "
                f"(0..{num_target_layers - 1})",
            )
    return tuple(ids)


def eagle3_hf_config(
    target_hf_config: Mapping[str, Any],
    draft_vocab_size: int,
    aux_layer_ids: Sequence[int],
    torch_dtype: str = "float32",
) -> dict[str, Any]:
    """config.json of a new head for ``target_hf_config``: the target's layer shapes, one layer."""
    t = target_hf_config
    arch = DecoderArch.from_hf(dict(t))
    config: dict[str, Any] = {
        "architectures": [EAGLE3_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position,
        "vocab_size": arch.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": arch.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
    }
    if arch.rope_scaling.get("rope_type", "default") != "default":
        config["rope_scaling"] = dict(arch.rope_scaling)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in t:
            config[key] = t[key]
    return config


class Eagle3MidLayer(nn.Module):
    """The head's one decoder layer: attention reads the token's embedding and the hidden state."""

    def __init__(
        self,
        arch: DecoderArch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        norm_before_residual: bool,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, rotary, backend)
        # q/k/v read [normed embedding, normed hidden] side by side: 2 * hidden inputs.
        self.self_attn.qkv_proj = MergedLinear(2 * arch.hidden_size, self.self_attn.qkv_sizes, arch.qkv_bias)
        self.mlp = LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # positions [T]; embeds, hidden [T, hidden] -> [T, hidden] (pre-norm output)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2 * hidden]
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h), residual)
        return self.mlp(h) + residual


class Eagle3DraftModel(nn.Module):
    """An EAGLE3 head (layout and step in the module docstring).

    The engine binds the one attention layer's KV cache (``attention_layers()``, sized by
    ``num_kv_heads``, ``head_dim`` and ``num_layers``) and runs ``forward`` inside
    ``set_forward_context``, as it runs the target.
    """

    num_layers = 1

    def __init__(self, config: Eagle3Config, backend: AttentionBackend) -> None:
        super().__init__()
        arch = config.arch
        self.config = config
        self.aux_layer_ids = config.aux_layer_ids
        self.draft_vocab_size = config.draft_vocab_size
        self.vocab_size = arch.vocab_size
        self.num_kv_heads, self.head_dim = arch.num_kv_heads, arch.head_dim
        fc_in = len(config.aux_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(fc_in, arch.hidden_size, bias=False)
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position, arch.rope_theta, arch.rope_scaling)
        self.midlayer = Eagle3MidLayer(arch, rotary, backend, config.norm_before_residual)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(arch.vocab_size, dtype=torch.bool))
        # The head's own embedding, only where its checkpoint has one (see share_embeddings).
        self.embed_tokens: nn.Embedding | None = None
        # The target's embedding, held outside this module tree: the target owns it, so this
        # head's parameters(), state_dict() and optimizer never include it.
        self._target_embed: tuple[nn.Embedding, ...] = ()

    # -- serving ------------------------------------------------------------------------------

    def share_embeddings(self, target: nn.Module) -> None:
        """Embed tokens with ``target.model.embed_tokens`` (an own copy that equals it is dropped)."""
        embed = target.model.embed_tokens
        expected = (self.vocab_size, self.config.arch.hidden_size)
        if tuple(embed.weight.shape) != expected:
            raise ValueError(
                f"the target's embed_tokens have shape {tuple(embed.weight.shape)}; the EAGLE3 head "
                f"needs {expected}"
            )
        if self.embed_tokens is not None:
            own = self.embed_tokens.weight
            if not torch.equal(own, embed.weight.to(own.device, own.dtype)):
                logger.info("the EAGLE3 head keeps its own embed_tokens, which differ from the target's")
                return
            self.embed_tokens = None
        self._target_embed = (embed,)

    @property
    def dtype(self) -> torch.dtype:
        """What the head computes in: its weights' dtype (a packed linear keeps no ``weight``)."""
        return self.norm.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [...] -> [..., hidden]
        embed = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding()
        return embed(input_ids).to(self.dtype)

    def _shared_embedding(self) -> nn.Embedding:
        assert self._target_embed, "call share_embeddings(target) before the first forward"
        return self._target_embed[0]

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        # [..., len(aux_layer_ids) * target_hidden] -> [..., hidden]
        return self.fc(aux.to(self.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [T]; hidden [T, hidden] -> [T, hidden] pre-norm output
        return self.midlayer(positions, self.embed(input_ids), hidden)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [..., hidden] -> [..., draft_vocab] float32
        return self.lm_head(self.norm(hidden)).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # [...] draft ids -> [...] int64 target ids
        return draft_ids.long() + self.d2t[draft_ids.long()]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    # -- training -----------------------------------------------------------------------------

    def forward_dense(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        prev_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One step over [B, L] rows with the same weights as ``forward``, attention dense.

        input_ids, positions [B, L]; hidden [B, L, hidden] -> (out [B, L, hidden], this step's
        (k, v), each [B, num_kv_heads, L, head_dim]). Without ``prev_kv`` attention is causal
        over the row (what ``forward`` computes over a paged sequence). With the (k, v) of the
        earlier unrolled steps (step 0 first) it is the test-time view of step j at row index i
        (EAGLE3's training-time test): step 0's keys at indices <= i, then each later step's key
        at index i only, its own included, as the engine's draft cache holds them when drafting.
        """
        layer = self.midlayer
        normed = torch_rms_norm(layer.hidden_norm, hidden)
        residual = normed if layer.norm_before_residual else hidden
        h = torch.cat([torch_rms_norm(layer.input_layernorm, self.embed(input_ids)), normed], dim=-1)
        attn_out, kv = _dense_attention(layer.self_attn, positions, h, prev_kv)
        h = residual + attn_out
        residual = h
        h = torch_rms_norm(layer.post_attention_layernorm, h)
        gate, up = layer.mlp.gate_up_proj(h).chunk(2, dim=-1)
        return layer.mlp.down_proj(F.silu(gate) * up) + residual, kv

    def dense_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [..., hidden] -> [..., draft_vocab], in torch (differentiable) like compute_draft_logits
        return self.lm_head(torch_rms_norm(self.norm, hidden))

    # -- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], path: str = "<weights>") -> None:
        """Copy a public-format checkpoint; every tensor but t2d must be there exactly once."""
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if _canonical(name) in tensors:
                raise _fail(path, f"checkpoint tensor {name!r} is given twice, under two names")
            tensors[_canonical(name)] = tensor
        if "embed_tokens.weight" in tensors:
            w = self.fc.weight
            shape = (self.vocab_size, self.config.arch.hidden_size)
            self.embed_tokens = nn.Embedding(*shape, device=w.device, dtype=w.dtype)
        d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)  # derived from d2t below (vLLM, too, reads only d2t)
        try:
            load_by_name(self, tensors.items(), lambda name: name, stacked=STACKED_PARAMS)
        except ValueError as e:
            raise _fail(path, str(e)) from None
        self._load_vocab_map(d2t, path)

    def _load_vocab_map(self, d2t: torch.Tensor | None, path: str) -> None:
        draft_vocab, vocab = self.draft_vocab_size, self.vocab_size
        if d2t is None:
            if draft_vocab != vocab:
                raise _fail(
                    path, f"the checkpoint lacks d2t, needed for draft_vocab_size {draft_vocab} < {vocab}"
                )
            d2t = torch.zeros(draft_vocab, dtype=torch.int64)
        if tuple(d2t.shape) != (draft_vocab,):
            raise _fail(path, f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
        target_ids = torch.arange(draft_vocab) + d2t.long().cpu()
        bad = (target_ids < 0) | (target_ids >= vocab)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise _fail(
                path, f"d2t maps draft id {i} to {int(target_ids[i])}, outside the vocabulary of {vocab}"
            )
        with torch.no_grad():
            self.d2t.copy_(d2t.long())
            self.t2d.zero_()
            self.t2d[target_ids.to(self.t2d.device)] = True

    def set_vocab_map(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: draft id i is target id ``target_ids[i]`` (ascending, unique)."""
        assert target_ids.shape == (self.draft_vocab_size,), f"{tuple(target_ids.shape)} target ids"
        d2t = target_ids.long().cpu() - torch.arange(self.draft_vocab_size)
        self._load_vocab_map(d2t, "<vocabulary>")

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under the public checkpoint's names (merged layers split again), on the CPU."""
        out: dict[str, torch.Tensor] = {}
        modules = dict(self.named_modules())
        for name, param in self.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            prefix, _, short = module_name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, MergedLinear) and short in _UNSTACKED:
                parts = param.detach().split(module.output_sizes, dim=0)
                for shard, part in zip(_UNSTACKED[short], parts, strict=True):
                    out[f"{prefix}.{shard}.{leaf}"] = part
            else:
                out[name] = param.detach()
        out["d2t"], out["t2d"] = self.d2t, self.t2d
        return {name: t.cpu().contiguous() for name, t in out.items()}


def _canonical(name: str) -> str:
    """A checkpoint name without its ``model.`` prefix; ``layers.0.`` read as ``midlayer.``."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def torch_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` in torch (HF's arithmetic), differentiable: axon's C++ kernel, which RMSNorm
    runs when loaded, has no backward."""
    return norm._norm(x)


def _dense_attention(
    attn: LlamaAttention,
    positions: torch.Tensor,  # [B, L]
    x: torch.Tensor,  # [B, L, 2 * hidden]
    prev_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(out [B, L, hidden], (k, v) [B, KVH, L, D]); the step's view of keys in forward_dense."""
    b, n = x.shape[:2]
    q, k, v = attn.qkv_proj(x).split(attn.qkv_sizes, dim=-1)
    q = _rope(attn.rotary, positions, q.view(b, n, attn.num_heads, attn.head_dim)).transpose(1, 2)
    k = _rope(attn.rotary, positions, k.view(b, n, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
    v = v.view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    scale = attn.attn.spec.scale
    if not prev_kv:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = _unrolled_attention(q, [*prev_kv, (k, v)], scale)
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1)), (k, v)


def _unrolled_attention(
    q: torch.Tensor,  # [B, H, L, D]
    kvs: Sequence[tuple[torch.Tensor, torch.Tensor]],  # step 0 .. j, each [B, KVH, L, D]
    scale: float,
) -> torch.Tensor:  # [B, H, L, D]
    """Query i reads step 0's keys 0..i and the key at index i of every later step."""
    group = q.shape[1] // kvs[0][0].shape[1]
    keys = [k.repeat_interleave(group, dim=1) for k, _ in kvs]  # each [B, H, L, D]
    values = [v.repeat_interleave(group, dim=1) for _, v in kvs]
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    first = (q @ keys[0].transpose(-1, -2)) * scale  # [B, H, L, L]
    first = first.masked_fill(~causal, float("-inf"))
    diagonal = torch.stack([(q * k).sum(-1) * scale for k in keys[1:]], dim=-1)  # [B, H, L, j]
    probs = torch.softmax(torch.cat([first, diagonal], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :n] @ values[0]
    for step, v in enumerate(values[1:]):
        out = out + probs[..., n + step, None] * v
    return out


def _rope(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # positions [B, L]; x [B, L, heads, D]: the neox rotation of RotaryEmbedding's torch path
    cos = rotary.cos_cached[positions].to(x.dtype).unsqueeze(2)  # [B, L, 1, D]
    sin = rotary.sin_cached[positions].to(x.dtype).unsqueeze(2)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# -- loading and saving -------------------------------------------------------------------------


def init_eagle3_weights(model: Eagle3DraftModel, seed: int) -> None:
    """Random weights for a new head: N(0, 0.02) matrices, unit norms (what training starts from)."""
    generator = torch.Generator(model.fc.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)


def build_eagle3(
    config: Eagle3Config, dtype: torch.dtype, device: torch.device | str, backend: AttentionBackend
) -> Eagle3DraftModel:
    """A head with uninitialised weights (load or initialise them next) and computed buffers."""
    model = build_empty(lambda: Eagle3DraftModel(config, backend), dtype, device)
    model.midlayer.self_attn.rotary.reset_buffers()
    with torch.no_grad():
        model.d2t.zero_()
        model.t2d.fill_(True)
    return model


def load_eagle3(
    path: str,
    target_hf_config: Mapping[str, Any],
    dtype: torch.dtype,
    device: torch.device | str,
    backend: AttentionBackend,
) -> Eagle3DraftModel:
    """The head at ``path`` for a target of ``target_hf_config``; call ``share_embeddings`` next."""
    config = parse_eagle3_config(_read_config(path), target_hf_config, path)
    model = build_eagle3(config, dtype, device, backend)
    model.load_weights(_iterate_weights(path), path)
    return model.eval()


def _iterate_weights(path: str) -> Iterable[tuple[str, torch.Tensor]]:
    folder = os.path.expanduser(path)
    legacy = os.path.join(folder, LEGACY_WEIGHTS_FILE)
    has_safetensors = any(name.endswith(".safetensors") for name in os.listdir(folder))
    if not has_safetensors and os.path.isfile(legacy):
        # weights_only: tensors and plain containers only, never code from the file.
        return torch.load(legacy, map_location="cpu", weights_only=True).items()
    try:
        return list(iterate_safetensors(folder))
    except ValueError as e:
        raise _fail(path, str(e)) from None


def save_eagle3(
    model_or_state: Eagle3DraftModel | Mapping[str, torch.Tensor], path: str, config: Mapping[str, Any]
) -> None:
    """Write ``config`` as config.json and the weights as model.safetensors, in the public format."""
    if isinstance(model_or_state, Eagle3DraftModel):
        state = model_or_state.public_state_dict()
    else:
        state = {_canonical(name): t.detach().cpu().contiguous() for name, t in model_or_state.items()}
    draft_vocab = config.get("draft_vocab_size")
    for key in ("lm_head.weight", "d2t"):
        shape = tuple(state[key].shape) if key in state else None
        if shape is None or shape[0] != draft_vocab:
            raise ValueError(
                f"{key} of shape {shape} does not fit the config's draft_vocab_size {draft_vocab}"
            )
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2)
        f.write("\n")
    save_file(state, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
