"""The GPU paged-KV kernels (native/triton_paged.py) against torch references: decode attention over random pages
(groups padded to a power of two, head_dim 64 and 128, a padding row of length 0) and the KV write that skips rows
marked -1. Needs CUDA and Triton."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


def _reference(q, chunks, table, lens, num_kv_heads, scale):
    """fp64 SDPA over each sequence's gathered blocks. table: [S, kv_heads, 2, max_blocks] chunk ids."""
    num_seqs, num_heads, head_dim = q.shape
    block = chunks.shape[1]
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        n = int(lens[s])
        if n == 0:
            continue
        nb = -(-n // block)
        k = chunks[table[s, :, 0, :nb]].reshape(num_kv_heads, nb * block, head_dim)[:, :n].double()
        v = chunks[table[s, :, 1, :nb]].reshape(num_kv_heads, nb * block, head_dim)[:, :n].double()
        o = F.scaled_dot_product_attention(q[s, :, None].double(), k.repeat_interleave(num_heads // num_kv_heads, 0),
                                           v.repeat_interleave(num_heads // num_kv_heads, 0), scale=scale)
        out[s] = o[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (14, 2, 128)])
@pytest.mark.parametrize("max_blocks", [3, 12, 64])   # 3: one pass; 12 and 64: contexts split, then combined
def test_decode_matches_sdpa(dtype, num_heads, num_kv_heads, head_dim, max_blocks):
    from elastic_hf.native.triton_paged import _num_splits, paged_decode_attention_triton

    torch.manual_seed(0)
    block, num_chunks = 16, 400
    chunks = torch.randn(num_chunks, block, head_dim, device="cuda").to(dtype)
    # 0: a padding row of a captured batch; 1000: over 62 blocks, most splits of the 64-block table
    lens = torch.tensor([1, 17, 190, 0, 64, 1000], device="cuda").clamp(max=max_blocks * block)
    assert (_num_splits(chunks.device, len(lens) * num_kv_heads, max_blocks) > 1) == (max_blocks > 3)
    num_seqs = len(lens)
    table = torch.randint(0, num_chunks - 8, (num_seqs, num_kv_heads, 2, max_blocks), device="cuda")
    offset = 8   # a later layer's chunks sit layer_chunk_offset further
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    paged_decode_attention_triton(q, chunks, table.flatten(), offset, lens, out, num_kv_heads, scale)
    want = _reference(q, chunks, table + offset, lens, num_kv_heads, scale)
    tol = 1e-5 if dtype == torch.float32 else 8e-3   # bf16: the output is rounded once (2^-8 relative)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_places_rows_and_skips_padding(dtype):
    from elastic_hf.native.triton_paged import paged_kv_write

    torch.manual_seed(1)
    num_kv_heads, tokens, head_dim, v_offset, layer_offset = 3, 5, 64, 16, 96
    rows = torch.zeros(2048, head_dim, device="cuda", dtype=dtype)
    # HF's projections are views: [1, kv_heads, T, hd] transposed from [1, T, kv_heads, hd]
    key = torch.randn(1, tokens, num_kv_heads, head_dim, device="cuda").to(dtype).transpose(1, 2)
    value = torch.randn(1, tokens, num_kv_heads, head_dim, device="cuda").to(dtype).transpose(1, 2)
    # K rows 32 apart: a K row (r) and a V row (r + 16) never collide
    write = torch.randperm(28, device="cuda")[:tokens * num_kv_heads] * 32
    write[-num_kv_heads:] = -1          # the last token is padding
    paged_kv_write(rows, write, layer_offset, v_offset, key, value)
    want = torch.zeros_like(rows)
    keep = write >= 0
    k_rows = key[0].transpose(0, 1).reshape(-1, head_dim)[keep]             # [live tokens * kv_heads, hd]
    v_rows = value[0].transpose(0, 1).reshape(-1, head_dim)[keep]
    want.index_copy_(0, write[keep] + layer_offset, k_rows)
    want.index_copy_(0, write[keep] + layer_offset + v_offset, v_rows)
    assert torch.equal(rows, want)
