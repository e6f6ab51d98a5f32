"""Bucket lists: defaults, validation (each error names the bad value), the choice of a bucket,
and padding that never changes a result."""

from __future__ import annotations

import pytest
import torch

from axon.config import build_config, replace
from axon.forward_context import set_forward_context
from axon.model.layers.attention import CommonAttentionMetadata
from axon.worker.buckets import Buckets, bucket_name, parse_bucket_list, powers_of_two, resolve_bucket_lists


def _resolved(max_num_seqs: int = 8, max_num_batched_tokens: int = 512, max_model_len: int = 1024, **kw):
    config = build_config(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **kw)
    return replace(config, model_config=replace(config.model_config, max_model_len=max_model_len))


def resolve_buckets(config) -> Buckets:
    """What resolve_config() stores and the worker reads."""
    return Buckets.from_config(replace(config, compilation_config=resolve_bucket_lists(config)))


def test_defaults_are_powers_of_two_ending_at_the_maxima() -> None:
    b = resolve_buckets(_resolved(max_num_seqs=12, max_num_batched_tokens=600))
    assert b.num_seqs == (1, 2, 4, 8, 12)
    assert b.num_batched_tokens == (128, 256, 512, 600)
    assert b.decode_context_length == ()
    assert b.token_sizes == (1, 2, 4, 8, 12, 128, 256, 512, 600)
    assert powers_of_two(1, 1) == (1,)


def test_flags_and_neuron_config_agree_or_fail() -> None:
    neuron = {"neuron_config": {"num_seqs_buckets": [2, 8], "decode_context_length_buckets": [256, 512]}}
    b = resolve_buckets(_resolved(additional_config=neuron, num_batched_tokens_buckets="64,512"))
    assert b.num_seqs == (2, 8) and b.num_batched_tokens == (64, 512)
    assert b.decode_context_length == (256, 512)
    with pytest.raises(ValueError, match=r"num_seqs_buckets is given twice, as \[4, 8\]"):
        resolve_buckets(_resolved(additional_config=neuron, num_seqs_buckets=[4, 8]))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_seqs_buckets": [1, 4, 2, 8]}, "strictly ascending, but 2 follows 4"),
        ({"num_seqs_buckets": [0, 8]}, "value 0 is not positive"),
        ({"num_seqs_buckets": [1, 4]}, r"must end at max_num_seqs \(8\), but its last value is 4"),
        ({"num_batched_tokens_buckets": [128, 256]}, r"must end at max_num_batched_tokens \(512\)"),
        ({"decode_context_length_buckets": [100, 512]}, "value 100 is not a multiple of block_size 16"),
        ({"decode_context_length_buckets": [512, 1024]}, "value 1024 is not below max_model_len 1024"),
        ({"num_seqs_buckets": "1,two,8"}, "must be a list of integers such as 1,2,4, got '1,two,8'"),
        ({"additional_config": {"neuron_config": [1]}}, "neuron_config must be a JSON object"),
    ],
)
def test_bad_lists_name_the_value(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_buckets(_resolved(**kw))


def test_parse_bucket_list_forms() -> None:
    assert parse_bucket_list("x", "[1, 2, 4]") == (1, 2, 4)
    assert parse_bucket_list("x", (1, 2)) == (1, 2)
    assert parse_bucket_list("x", None) is None
    with pytest.raises(ValueError, match="list of integers"):
        parse_bucket_list("x", [1, True])


def test_smallest_bucket_that_fits() -> None:
    b = Buckets((128, 512), (1, 4, 8), (256,), block_size=16, max_model_len=1024)
    assert [b.pad_tokens(n, is_decode=True) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    # A prefill (or mixed) step takes a token bucket; one that no list of its kind holds, the next size.
    assert [b.pad_tokens(n, is_decode=False) for n in (3, 128, 129, 512)] == [128, 128, 512, 512]
    with pytest.raises(ValueError, match="513 tokens exceeds the largest bucket 512"):
        b.pad_tokens(513, is_decode=False)
    # Context buckets pad the block table: 256 tokens = 16 blocks, then max_model_len = 64 blocks.
    assert [b.pad_context_blocks(n) for n in (1, 16, 17, 64)] == [16, 16, 64, 64]
    assert Buckets((8,), (8,), (), 16, 64).pad_context_blocks(3) == 3
    assert bucket_name(8, True) == "decode_b8" and bucket_name(512, False) == "prefill_s512"


def test_padding_never_changes_logits(tiny_model_dir) -> None:
    """The same step with and without padded rows and a padded block table: equal hidden states
    on the real rows, and no KV written for the padded ones."""
    from axon.engine.arg_utils import create_engine_config
    from axon.worker.worker import Worker

    config = create_engine_config(model=tiny_model_dir("llama"), dtype="float32", num_gpu_blocks_override=32)
    worker = Worker(config)
    # Resolved once, into the config, and read from there by the worker.
    comp = config.compilation_config
    assert comp.num_seqs_buckets is not None and comp.num_batched_tokens_buckets is not None
    assert comp.decode_context_length_buckets == ()
    assert worker.buckets == Buckets.from_config(config)
    assert worker.buckets.num_seqs == comp.num_seqs_buckets
    worker.initialize_kv_cache(32)
    model, layers = worker.model, worker.model.attention_layers()
    g = torch.Generator().manual_seed(0)
    # Two requests: a 5-token prefill (blocks 1, 2) and a 3-token one (block 3), block size 16.
    ids = torch.randint(0, 512, (8,), generator=g)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    slots = torch.tensor([16, 17, 18, 19, 20, 48, 49, 50])
    table = torch.tensor([[1, 2], [3, 0]])

    def run(pad_rows: int, pad_cols: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for k, v in worker.kv_caches:
            k.zero_(), v.zero_()
        md = CommonAttentionMetadata(
            num_actual_tokens=8,
            slot_mapping=torch.cat([slots, torch.full((pad_rows,), -1)]),
            query_start_loc=[0, 5, 8],
            seq_lens=[5, 3],
            block_table=torch.cat([table, torch.zeros(2, pad_cols, dtype=torch.int64)], dim=1),
            block_size=16,
        )
        with torch.inference_mode(), set_forward_context(md, layers):
            hidden = model(
                torch.cat([ids, torch.zeros(pad_rows, dtype=torch.int64)]),
                torch.cat([positions, torch.zeros(pad_rows, dtype=torch.int64)]),
            )
        return hidden, [k.clone() for k, _ in worker.kv_caches]

    exact, kv_exact = run(0, 0)
    padded, kv_padded = run(8, 6)
    assert padded.shape[0] == 16
    torch.testing.assert_close(padded[:8], exact, rtol=0, atol=0)
    for a, b in zip(kv_exact, kv_padded, strict=True):
        assert torch.equal(a, b)
