"""EAGLE3: the target's aux hidden states, the head's public format, and paged == dense forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from axon.config import ModelConfig
from axon.forward_context import set_forward_context
from axon.model.layers.attention import Segment, describe_step, get_attention_backend
from axon.model.loader import load_hf_config
from axon.model.loader.model_loader import load_model
from axon.model.models.llama import default_aux_layers
from axon.spec_decode.eagle3 import (
    Eagle3DraftModel,
    build_eagle3,
    check_eagle3_config,
    eagle3_hf_config,
    init_eagle3_weights,
    load_eagle3,
    parse_eagle3_config,
    save_eagle3,
)

BLOCK_SIZE = 4
DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DIMS, tie_word_embeddings=False)).eval()
    folder = tmp_path_factory.mktemp("eagle3-target")
    model.save_pretrained(folder)
    return str(folder)


def _load_target(folder: str):
    config = ModelConfig(model_path=folder, hf_config=load_hf_config(folder), load_format="safetensors")
    return load_model(config, torch.float32, torch.device("cpu"), get_attention_backend("reference"))


def _bind_caches(layers, num_blocks: int, num_kv_heads: int, head_dim: int) -> None:
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(i, (torch.zeros(shape), torch.zeros(shape)))


def _target_forward(model, token_ids: torch.Tensor, forward=None):
    """The target's forward over one whole sequence through paged attention."""
    n = token_ids.shape[0]
    num_blocks = -(-n // BLOCK_SIZE) + 1
    _bind_caches(model.attention_layers(), num_blocks, model.arch.num_kv_heads, model.arch.head_dim)
    step = describe_step([Segment(list(range(1, num_blocks)), 0, n)], BLOCK_SIZE)
    with set_forward_context(step, model.attention_layers()), torch.no_grad():
        return (model if forward is None else forward)(token_ids, torch.arange(n))


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, DIMS["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def test_aux_hidden_states_are_the_layer_inputs(target_dir: str) -> None:
    model = _load_target(target_dir)
    ids = _tokens(23)
    plain = _target_forward(model, ids)
    assert isinstance(plain, torch.Tensor)
    hf = tf.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        # hidden_states[i] is the input of layer i (hidden_states[0]: the embeddings).
        expected = hf(ids[None], output_hidden_states=True).hidden_states
    for layer_ids in [(0, 2, 3), (3, 1, 1)]:
        model.set_aux_hidden_state_layers(layer_ids)
        hidden, aux = _target_forward(model, ids)
        assert aux.shape == (23, 3 * DIMS["hidden_size"])
        torch.testing.assert_close(hidden, plain, atol=0, rtol=0)  # the main output is unchanged
        want = torch.cat([expected[i][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(aux, want, atol=1e-5, rtol=1e-5)
    model.set_aux_hidden_state_layers(())
    assert isinstance(_target_forward(model, ids), torch.Tensor)


def test_aux_layer_ids_are_checked(target_dir: str) -> None:
    model = _load_target(target_dir)
    with pytest.raises(ValueError, match="aux hidden state layer 4 is not a layer"):
        model.set_aux_hidden_state_layers((0, 4))
    assert default_aux_layers(30) == (2, 15, 27)


@pytest.mark.parametrize("layer_ids", [(), (1, 2, 3)])
def test_compiled_target_equals_eager(target_dir: str, layer_ids: tuple[int, ...]) -> None:
    model = _load_target(target_dir)
    model.set_aux_hidden_state_layers(layer_ids)
    ids = _tokens(16, seed=3)
    eager = _target_forward(model, ids)
    torch._dynamo.reset()
    compiled = _target_forward(model, ids, torch.compile(model, fullgraph=True, dynamic=False))
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


# -- the head -------------------------------------------------------------------------------------


def _target_hf() -> dict:
    return tf.LlamaConfig(**DIMS).to_dict()


def _head(draft_vocab: int = 96, seed: int = 0, **overrides) -> tuple[Eagle3DraftModel, dict]:
    config = {**eagle3_hf_config(_target_hf(), draft_vocab, (0, 2, 3)), **overrides}
    head = build_eagle3(
        parse_eagle3_config(config, _target_hf()), torch.float32, "cpu", get_attention_backend("reference")
    )
    init_eagle3_weights(head, seed)
    ids = torch.randperm(DIMS["vocab_size"], generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head.set_vocab_map(ids.sort().values)
    return head, config


def test_save_load_round_trip(tmp_path: Path) -> None:
    head, config = _head()
    save_eagle3(head, str(tmp_path), config)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight"} <= set(tensors)
    assert "embed_tokens.weight" not in tensors  # shared with the target
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == 96
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    loaded = load_eagle3(
        str(tmp_path), _target_hf(), torch.float32, "cpu", get_attention_backend("reference")
    )
    assert loaded.aux_layer_ids == (0, 2, 3) and loaded.draft_vocab_size == 96
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    draft_ids = torch.arange(96)
    assert torch.equal(loaded.draft_to_target(draft_ids), head.draft_to_target(draft_ids))
    assert bool(loaded.t2d[loaded.draft_to_target(draft_ids)].all())


def test_names_with_the_model_prefix_load(tmp_path: Path) -> None:
    head, config = _head()
    save_eagle3({f"model.{k}": v for k, v in head.public_state_dict().items()}, str(tmp_path), config)
    loaded = load_eagle3(
        str(tmp_path), _target_hf(), torch.float32, "cpu", get_attention_backend("reference")
    )
    assert torch.equal(loaded.fc.weight, head.fc.weight)


def _write_config(folder: Path, **changes) -> str:
    config = {**eagle3_hf_config(_target_hf(), 96, (0, 2, 3)), **changes}
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_hidden_size": 1024}, "target_hidden_size 1024 differs from the target's hidden_size 64"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures \\['LlamaForCausalLM'\\] name no EAGLE3"),
        ({"vocab_size": 1000}, "vocab_size 1000 differs from the target's vocab_size 512"),
        ({"draft_vocab_size": None}, "lacks draft_vocab_size"),
        ({"draft_vocab_size": 600}, "draft_vocab_size 600 is not between 1 and vocab_size 512"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 9]}},
            "holds 9, not a layer of the target",
        ),
        ({"num_hidden_layers": 2}, "num_hidden_layers 2"),
    ],
)
def test_bad_configs_name_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    folder = _write_config(tmp_path / "head", **changes)
    with pytest.raises(ValueError, match=f"speculative_config.model: EAGLE3 head .*{message}"):
        check_eagle3_config(folder, _target_hf())


def test_default_aux_layers_when_the_config_names_none(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "head", eagle_config=None)
    assert parse_eagle3_config(check_eagle3_config(folder, _target_hf()), _target_hf()).aux_layer_ids == (
        2,
        2,
        1,
    )


def test_bad_weights_name_the_tensor(tmp_path: Path) -> None:
    head, config = _head()
    state = head.public_state_dict()
    save_eagle3({**state, "fc.weight": state["fc.weight"][:, :64]}, str(tmp_path / "a"), config)
    with pytest.raises(ValueError, match="'fc.weight' has shape \\(64, 64\\), expected \\(64, 192\\)"):
        load_eagle3(
            str(tmp_path / "a"), _target_hf(), torch.float32, "cpu", get_attention_backend("reference")
        )
    del state["norm.weight"]
    save_eagle3(state, str(tmp_path / "b"), config)
    with pytest.raises(ValueError, match="lacks 1 tensors.*norm.weight"):
        load_eagle3(
            str(tmp_path / "b"), _target_hf(), torch.float32, "cpu", get_attention_backend("reference")
        )


def test_own_embeddings_are_kept_unless_they_equal_the_targets(tmp_path: Path, target_dir: str) -> None:
    target = _load_target(target_dir)
    head, config = _head()
    embed = target.model.embed_tokens.weight.detach()
    for own, shared in [(embed.clone(), True), (embed + 1.0, False)]:
        save_eagle3({**head.public_state_dict(), "embed_tokens.weight": own}, str(tmp_path), config)
        loaded = load_eagle3(
            str(tmp_path), _target_hf(), torch.float32, "cpu", get_attention_backend("reference")
        )
        loaded.share_embeddings(target)
        assert (loaded.embed_tokens is None) == shared
        assert torch.equal(loaded.embed(torch.tensor([5])), own[5:6])


# -- paged == dense ---------------------------------------------------------------------------------


def _paged_draft(head: Eagle3DraftModel, ids: torch.Tensor, aux: torch.Tensor, n: int, steps: int) -> list:
    """The engine's view: step 0 over positions 0..n-1 (token p + 1, target aux at p), then each
    later step one query at the next position fed its predecessor's last output. Returns each
    step's output at its last row."""
    num_blocks = -(-(n + steps) // BLOCK_SIZE) + 1
    blocks = list(range(num_blocks - 1, 0, -1))  # reversed, so a wrong lookup cannot pass
    layers = head.attention_layers()
    _bind_caches(layers, num_blocks, head.num_kv_heads, head.head_dim)
    hidden = head.combine_hidden_states(aux[:n])
    outs = []
    with torch.no_grad():
        for j in range(steps):
            start, end = (0, n) if j == 0 else (n + j - 1, n + j)
            with set_forward_context(describe_step([Segment(blocks, start, end)], BLOCK_SIZE), layers):
                hidden = head(ids[start + 1 : end + 1], torch.arange(start, end), hidden)
            outs.append(hidden[-1])
            hidden = hidden[-1:]
    return outs


def test_paged_forward_equals_dense_forward(target_dir: str) -> None:
    target = _load_target(target_dir)
    head, _ = _head()
    head.share_embeddings(target)
    length, steps = 19, 3
    ids = _tokens(length + steps + 1, seed=4)
    aux = torch.randn(length + steps, 3 * 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the training path: [B, L] rows, dense attention, unrolled steps
        hidden = head.combine_hidden_states(aux[:length])[None]
        dense, kvs = [], []
        for j in range(steps):
            positions = torch.arange(j, length + j)[None]
            hidden, kv = head.forward_dense(ids[None, 1 + j : length + 1 + j], positions, hidden, kvs)
            dense.append(hidden[0])
            kvs.append(kv)
        torch.testing.assert_close(
            head.dense_draft_logits(dense[0]), head.compute_draft_logits(dense[0]), atol=1e-5, rtol=1e-5
        )
    # Step 0 over the whole row, then the unrolled steps drafted after prefixes of several lengths.
    hidden0 = _paged_full_step0(head, ids, aux, length)
    torch.testing.assert_close(hidden0, dense[0], atol=1e-5, rtol=1e-5)
    for n in (1, 6, length):
        for j, out in enumerate(_paged_draft(head, ids, aux, n, steps)):
            torch.testing.assert_close(out, dense[j][n - 1], atol=1e-5, rtol=1e-5)


def _paged_full_step0(head: Eagle3DraftModel, ids: torch.Tensor, aux: torch.Tensor, n: int) -> torch.Tensor:
    num_blocks = -(-n // BLOCK_SIZE) + 1
    layers = head.attention_layers()
    _bind_caches(layers, num_blocks, head.num_kv_heads, head.head_dim)
    step = describe_step([Segment(list(range(1, num_blocks)), 0, n)], BLOCK_SIZE)
    with set_forward_context(step, layers), torch.no_grad():
        return head(ids[1 : n + 1], torch.arange(n), head.combine_hidden_states(aux[:n]))


def test_weights_file_is_plain_safetensors(tmp_path: Path) -> None:
    """What vLLM's loader reads: every tensor under its public name, no merged layers."""
    head, config = _head()
    save_eagle3(head, str(tmp_path), config)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert load_eagle3(str(tmp_path), _target_hf(), torch.float32, "cpu", get_attention_backend("reference"))


def test_paged_forward_with_cpu_kernels_equals_dense_forward(target_dir: str, kernel_cache_root: str) -> None:
    """The engine runs the head's norms, rotary and MLP on axon's C++ kernels; training in torch."""
    from axon.platforms.cpu_kernels import load_cpu_kernels

    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("axon's CPU kernels could not be built here")
    target = _load_target(target_dir)
    head, _ = _head(seed=1)
    head.share_embeddings(target)
    ids = _tokens(12, seed=6)
    aux = torch.randn(11, 3 * 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        dense, _ = head.forward_dense(
            ids[None, 1:11], torch.arange(10)[None], head.combine_hidden_states(aux[:10])[None]
        )
    torch.testing.assert_close(_paged_full_step0(head, ids, aux, 10), dense[0], atol=1e-4, rtol=1e-4)
