"""The EAGLE3 proposer's recurrence: drafts equal the training-time (dense, unrolled) view of the
same head, however the target's rows reached it (one prefill, chunks, skipped steps, a
verification that rejected some drafts)."""

from __future__ import annotations

import pytest
import torch

from axon.config import ModelConfig
from axon.model.layers.attention import get_attention_backend
from axon.model.loader import load_hf_config
from axon.model.loader.model_loader import load_model
from axon.spec_decode import eagle3_proposer
from axon.spec_decode.eagle3 import build_eagle3, eagle3_hf_config, init_eagle3_weights, parse_eagle3_config
from axon.spec_decode.eagle3_proposer import Eagle3Proposer
from axon.spec_decode.proposer import DraftBatch, DraftRequest

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # blocks 1..11 for one request, 12..23 for another (0 is the null block)
K = 3
PROMPT_LEN = 21


@pytest.fixture
def proposer(tiny_model_dir) -> Eagle3Proposer:
    folder = tiny_model_dir("llama")
    hf = load_hf_config(folder)
    backend = get_attention_backend("reference")
    target = load_model(
        ModelConfig(model_path=folder, hf_config=hf), torch.float32, torch.device("cpu"), backend
    )
    config = eagle3_hf_config(hf, draft_vocab_size=256, aux_layer_ids=(0, 1, 1))
    head = build_eagle3(parse_eagle3_config(config, hf), torch.float32, "cpu", backend)
    init_eagle3_weights(head, seed=1)
    with torch.no_grad():  # N(0, 0.3): every input (token, position, hidden) sways the drafts
        for name, param in head.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(15.0)
    head.set_vocab_map(torch.arange(0, hf["vocab_size"], 2))
    proposer = Eagle3Proposer(head, target, BLOCK_SIZE, torch.device("cpu"))
    assert target.aux_layer_ids == (0, 1, 1)
    shape = (NUM_BLOCKS, BLOCK_SIZE, head.num_kv_heads, head.head_dim)
    for i, layer in enumerate(proposer.kv_layers()):
        layer.bind_kv_cache(i, (torch.zeros(shape), torch.zeros(shape)))
    return proposer


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _aux(n: int, seed: int) -> torch.Tensor:
    # [n, 3 * hidden]: stand-ins for the target's aux rows (the proposer only combines them)
    return torch.randn(n, 3 * 64, generator=torch.Generator().manual_seed(seed))


def _blocks(second: bool = False) -> list[int]:
    half = NUM_BLOCKS // 2
    return list(range(half, NUM_BLOCKS)) if second else list(range(1, half))


def _request(req_id: str, tokens: list[int], first: int, num_valid: int, wants: bool, row: int = 0, **kw):
    blocks = _blocks(**kw)
    return DraftRequest(req_id, tokens, blocks, row, first, num_valid, wants)


def _dense_drafts(head, tokens: list[int], aux: torch.Tensor, k: int) -> list[int]:
    """Training's view: step 0 over positions 0..L-2 (token p + 1, aux at p), step j fed the
    previous step's output and draft; the drafts at the last row."""
    n = len(tokens) - 1
    tokens, kvs = list(tokens), []
    hidden = head.combine_hidden_states(aux[:n])[None]  # [1, n, hidden]
    for j in range(k):
        ids = torch.tensor(tokens[1 + j : n + 1 + j])[None]
        hidden, kv = head.forward_dense(ids, torch.arange(j, n + j)[None], hidden, kvs)
        kvs.append(kv)
        draft_id = head.compute_draft_logits(hidden[0, -1:]).argmax(dim=-1)
        tokens.append(int(head.draft_to_target(draft_id)))
    return tokens[n + 1 :]


@torch.inference_mode()
def test_drafts_follow_the_dense_recurrence_after_a_rejection(proposer: Eagle3Proposer) -> None:
    tokens, aux = _tokens(PROMPT_LEN + 1, seed=2), _aux(PROMPT_LEN + 8, seed=3)
    # Prefill: rows 0..20 valid, x_21 sampled.
    batch = DraftBatch([_request("a", tokens, 0, PROMPT_LEN, True)], K, aux[:PROMPT_LEN])
    [drafts] = proposer.propose(batch)
    assert drafts == _dense_drafts(proposer.head, tokens, aux, K)
    # Verification of x_21 and the 3 drafts (rows for positions 21..24): the first draft is
    # accepted, then a token the target chose instead of the second.
    tokens = tokens + [drafts[0], (drafts[1] + 1) % 512]
    rows = aux[PROMPT_LEN : PROMPT_LEN + 4]
    [drafts] = proposer.propose(DraftBatch([_request("a", tokens, PROMPT_LEN, 2, True)], K, rows))
    assert drafts == _dense_drafts(proposer.head, tokens, aux, K)


@pytest.mark.parametrize("max_pending_rows", [8192, 4])
@torch.inference_mode()
def test_prefill_segments_and_skipped_steps_catch_up(
    proposer: Eagle3Proposer, max_pending_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eagle3_proposer, "MAX_PENDING_ROWS", max_pending_rows)
    tokens, aux = _tokens(PROMPT_LEN + 1, seed=4), _aux(PROMPT_LEN, seed=5)
    expected = _dense_drafts(proposer.head, tokens, aux, K)
    other, other_aux = _tokens(6, seed=6), _aux(5, seed=7)
    # A step the policy drafts nothing in: the segment's rows wait, unless too many pile up.
    assert proposer.propose(DraftBatch([_request("a", tokens, 0, 8, False)], 0, aux[:8])) == [[]]
    assert proposer.pending["a"].num_rows == (8 if max_pending_rows > 8 else 0)
    # Beside a request that drafts: the segment catches up, drafting nothing.
    both = [_request("b", other, 0, 5, True, second=True), _request("a", tokens, 8, 8, False, row=5)]
    out = proposer.propose(DraftBatch(both, K, torch.cat([other_aux, aux[8:16]])))
    assert out[0] == _dense_drafts(proposer.head, other, other_aux, K) and out[1] == []
    assert proposer.pending["a"].start == 16 and not proposer.pending["a"].hidden
    [drafts] = proposer.propose(DraftBatch([_request("a", tokens, 16, 5, True)], K, aux[16:PROMPT_LEN]))
    assert drafts == expected
    proposer.forget(["a", "b"])
    assert not proposer.pending


@torch.inference_mode()
def test_drafts_stop_where_the_blocks_end(proposer: Eagle3Proposer) -> None:
    """Draft 2 would be fed at position L - 1 = 44, past the 11 blocks' slots 0..43: not drafted."""
    tokens, aux = _tokens(45, seed=8), _aux(44, seed=9)
    [drafts] = proposer.propose(DraftBatch([_request("a", tokens, 0, 44, True)], K, aux))
    assert len(drafts) == 1
