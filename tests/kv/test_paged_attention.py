"""The paged attention over the head-centric arena equals dense SDPA on the same K/V, for a packed batch that
mixes a fresh prefill, a chunked-prefill continuation and decodes of different lengths. Both CPU paths are checked:
the native kernels (causal prefill; decode in place from the pages) and the pure-torch ones (SDPA; chunk gather +
bmm), and the GPU's grouping of short fresh prefills into masked SDPA calls (run here on the CPU's SDPA)."""
import types

import pytest
import torch
import torch.nn.functional as F

from elastic_hf.kv import attention_backends
from elastic_hf.kv.kv_manager import KVManager
from elastic_hf.kv.layout import KVLayout
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.kv.paged_attention import paged_attention_forward
from elastic_hf.kv.paged_batch import build_paged_batch, prefill_groups
from elastic_hf.memory import MemoryBudget, create_arena

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


class _Layer(torch.nn.Module):
    def __init__(self, idx):
        super().__init__()
        self.layer_idx = idx


def _pool(num_blocks=64, num_layers=2):
    """(pool, kv manager): the pool's pages and the control plane's KV manager over the same block ids."""
    layout = KVLayout(num_layers, NUM_KV_HEADS, HEAD_DIM, BLOCK, torch.float32, 4096)
    budget = MemoryBudget(1 << 30)
    arena = create_arena("cpu", num_blocks * layout.block_bytes, budget, "kv")
    pool = KVPagePool(layout, arena, num_blocks, num_blocks)
    return pool, KVManager(pool.num_blocks, BLOCK)


@pytest.fixture(params=["native", "torch"])
def attention_path(request, monkeypatch):
    """The backend build_paged_batch picks for a CPU pool: the C kernels, or the torch path (SDPA for prefills,
    chunk gather + bmm for decodes) when they are not there."""
    if request.param == "torch":
        monkeypatch.setattr(attention_backends, "native_decode_available", lambda dtype, device: False)
    elif not (attention_backends.native_decode_available(torch.float32, torch.device("cpu"))
              and attention_backends.native_prefill_available(torch.float32, torch.device("cpu"))):
        pytest.skip("no C compiler here (or ELASTIC_HF_NATIVE=0): the native kernels are not built")
    expected = {"native": "cpu_native", "torch": "sdpa"}[request.param]
    assert attention_backends.choose_attention_backend(torch.device("cpu"), torch.float32, HEAD_DIM, BLOCK).name \
        == expected
    return request.param


def test_packed_mixed_batch_matches_dense_sdpa(attention_path):
    torch.manual_seed(0)
    pool, allocator = _pool()
    layer = _Layer(1)
    # Full K/V histories of three sequences; the cache is filled step by step through the attention itself.
    lengths = [9, 13, 6]
    k_full = [torch.randn(NUM_KV_HEADS, n, HEAD_DIM) for n in lengths]
    v_full = [torch.randn(NUM_KV_HEADS, n, HEAD_DIM) for n in lengths]
    q_full = [torch.randn(NUM_HEADS, n, HEAD_DIM) for n in lengths]
    tables = [allocator.allocate(-(-n // BLOCK)) for n in lengths]

    def step(chunks):  # chunks: (seq, start, end)
        meta = build_paged_batch(pool, [(s, e - s, tables[i]) for i, s, e in chunks])
        q = torch.cat([q_full[i][:, s:e] for i, s, e in chunks], dim=1).unsqueeze(0)
        k = torch.cat([k_full[i][:, s:e] for i, s, e in chunks], dim=1).unsqueeze(0)
        v = torch.cat([v_full[i][:, s:e] for i, s, e in chunks], dim=1).unsqueeze(0)
        out, _ = paged_attention_forward(layer, q, k, v, None, scaling=HEAD_DIM ** -0.5, paged_batch=meta)
        return out[0]  # [T, heads, hd]

    step([(0, 0, 5), (1, 0, 12), (2, 0, 5)])              # prefills; seq 0 is chunked
    out = step([(0, 5, 9), (1, 12, 13), (2, 5, 6)])       # continuation chunk + two decodes of different lengths

    rows = 0
    for i, (s, e) in enumerate([(5, 9), (12, 13), (5, 6)]):
        n = e
        mask = torch.arange(n)[None, :] <= torch.arange(s, e)[:, None]
        ref = F.scaled_dot_product_attention(q_full[i][:, s:e], k_full[i][:, :n], v_full[i][:, :n],
                                             attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out[rows:rows + e - s], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
        rows += e - s


def test_layers_do_not_overwrite_each_other():
    pool, allocator = _pool(num_blocks=4)
    table = allocator.allocate(1)
    meta = build_paged_batch(pool, [(0, 3, table)])
    for idx, fill in ((0, 1.0), (1, 2.0)):
        k = torch.full((1, NUM_KV_HEADS, 3, HEAD_DIM), fill)
        paged_attention_forward(_Layer(idx), torch.zeros(1, NUM_HEADS, 3, HEAD_DIM), k, -k, None,
                                paged_batch=meta)
    assert torch.all(pool.layer(0)[table[0], :, 0, :3] == 1.0)
    assert torch.all(pool.layer(1)[table[0], :, 0, :3] == 2.0)
    assert torch.all(pool.layer(1)[table[0], :, 1, :3] == -2.0)


def test_decodes_over_chunk_gather_match_sdpa_for_odd_head_dim_and_equal_lengths(attention_path):
    """Blocks are padded to whole [block_size, head_dim] chunks even when a chunk does not divide the page
    (head_dim 24 -> 384-byte chunks, 4096-byte pages, blocks straddling pages); decodes of equal lengths take the
    no-bias path."""
    torch.manual_seed(1)
    head_dim, num_layers = 24, 3
    layout = KVLayout(num_layers, NUM_KV_HEADS, head_dim, BLOCK, torch.float32, 4096)
    assert layout.block_bytes % layout.chunk_bytes == 0 and layout.block_bytes % 4096 != 0
    arena = create_arena("cpu", 16 * layout.block_bytes, MemoryBudget(1 << 30), "kv")
    pool = KVPagePool(layout, arena, 16, 16)
    allocator = KVManager(pool.num_blocks, BLOCK)
    layer = _Layer(2)
    n = 8  # two full blocks: no padded position, so no score bias
    k_full = [torch.randn(NUM_KV_HEADS, n, head_dim) for _ in range(2)]
    v_full = [torch.randn(NUM_KV_HEADS, n, head_dim) for _ in range(2)]
    q_full = [torch.randn(NUM_HEADS, n, head_dim) for _ in range(2)]
    tables = [allocator.allocate(2) for _ in range(2)]

    def step(chunks):
        meta = build_paged_batch(pool, [(s, e - s, tables[i]) for i, s, e in chunks])
        cat = lambda t: torch.cat([t[i][:, s:e] for i, s, e in chunks], dim=1).unsqueeze(0)  # noqa: E731
        return paged_attention_forward(layer, cat(q_full), cat(k_full), cat(v_full), None, scaling=0.3,
                                       paged_batch=meta)[0][0], meta

    step([(0, 0, n - 1), (1, 0, n - 1)])
    out, meta = step([(0, n - 1, n), (1, n - 1, n)])
    assert meta.decodes is not None and meta.decodes.score_bias(layout) is None
    for i in range(2):
        ref = F.scaled_dot_product_attention(q_full[i][:, n - 1:], k_full[i], v_full[i], scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[i:i + 1], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
    # the chunk view and the row view address the same memory
    block, head = tables[1][1], 1
    chunk = block * layout.chunks_per_block + layer.layer_idx * layout.chunks_per_layer + head * 2 + 1  # V
    row = block * layout.rows_per_block + layer.layer_idx * layout.rows_per_layer + head * 2 * BLOCK + BLOCK
    assert torch.equal(pool.chunks[chunk], pool.rows[row:row + BLOCK])
    torch.testing.assert_close(pool.chunks[chunk][:n - BLOCK], v_full[1][head, BLOCK:])


def test_grouped_fresh_prefills_match_dense_sdpa(monkeypatch):
    """prefill_groups (built on GPUs) packs short fresh prefills into block-diagonal masked calls; forced here on the
    CPU's torch path with a 16-token cap: [5, 7, 3] and [6, 9] group, the 20-token prompt attends alone, and a
    chunk continuing a cached context and a decode in the same step are untouched by the groups."""
    monkeypatch.setattr(attention_backends, "native_decode_available", lambda dtype, device: False)
    torch.manual_seed(1)
    pool, allocator = _pool(num_blocks=96)
    layer = _Layer(0)
    lengths = [4, 10, 5, 7, 3, 20, 6, 9]        # 0: decodes in step 2; 1: chunked 5 + 5; 2-7: fresh in step 2
    k_full = [torch.randn(NUM_KV_HEADS, n, HEAD_DIM) for n in lengths]
    v_full = [torch.randn(NUM_KV_HEADS, n, HEAD_DIM) for n in lengths]
    q_full = [torch.randn(NUM_HEADS, n, HEAD_DIM) for n in lengths]
    tables = [allocator.allocate(-(-n // BLOCK)) for n in lengths]

    def step(chunks, group_cap=None):
        meta = build_paged_batch(pool, [(s, e - s, tables[i]) for i, s, e in chunks])
        if group_cap is not None:
            meta.prefill_groups = prefill_groups(meta.prefills, torch.device("cpu"), max_tokens=group_cap)
        q, k, v = (torch.cat([t[i][:, s:e] for i, s, e in chunks], dim=1).unsqueeze(0)
                   for t in (q_full, k_full, v_full))
        out, _ = paged_attention_forward(layer, q, k, v, None, scaling=HEAD_DIM ** -0.5, paged_batch=meta)
        return out[0], meta

    step([(0, 0, 3), (1, 0, 5)])
    calls = []

    def counting_sdpa(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(attention_backends, "F", types.SimpleNamespace(scaled_dot_product_attention=counting_sdpa))
    chunks = [(0, 3, 4), (1, 5, 10)] + [(i, 0, lengths[i]) for i in range(2, 8)]
    out, meta = step(chunks, group_cap=16)
    assert [[p.q_len for p in g.members] for g in meta.prefill_groups] == [[5, 7, 3], [6, 9]]
    # per layer: two masked group calls, the continuation (masked) and the 20-token prompt (causal), not 7 calls
    assert sorted(calls) == [False, True, True, True]
    rows = 0
    for i, s, e in chunks:
        mask = torch.arange(e)[None, :] <= torch.arange(s, e)[:, None]
        ref = F.scaled_dot_product_attention(q_full[i][:, s:e], k_full[i][:, :e], v_full[i][:, :e],
                                             attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out[rows:rows + e - s], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
        rows += e - s
