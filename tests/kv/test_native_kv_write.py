"""The native K/V page write (elastic_hf/native/kv_write.c) against the torch path it replaces (a contiguous copy
of each strided view and index_copy_), on HF-shaped strided projections: a fused q/k/v product's column slices
viewed [1, kv_heads, T, head_dim]. Rows < 0 are padding and stay untouched; nothing else in the arena moves."""
import pytest
import torch

from elastic_hf.native import build
from elastic_hf.native.kv_write import native_kv_write_available, write_kv_rows

pytestmark = pytest.mark.skipif(not build.native_enabled() or build._compiler() is None,
                                reason="no C compiler here (or ELASTIC_HF_NATIVE=0)")


def hf_projections(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """key, value as HF's attention hands them over: views of one fused [T, (heads + 2 kv_heads) * hd] product."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width).to(dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    key = qkv[:, q_end:k_end].view(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2)
    value = qkv[:, k_end:].view(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2)
    return key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# 5 decodes; a 700-token prefill (crosses the kernel's threshold for using both threads)
@pytest.mark.parametrize("num_tokens", [5, 700])
def test_write_matches_index_copy(dtype, num_tokens):
    assert native_kv_write_available(torch.device("cpu"))
    torch.manual_seed(num_tokens)
    num_heads, num_kv_heads, head_dim, block = 9, 3, 64, 16
    key, value = hf_projections(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    arena_rows = 4 * num_tokens * num_kv_heads * 2 * block
    # distinct K rows, none within v_offset of another so no K row is another's V row
    slots = torch.randperm(arena_rows // (2 * block) - 4)[:num_tokens * num_kv_heads]
    write_k_rows = slots * 2 * block + torch.randint(0, block, slots.shape)
    write_k_rows[3] = -1                                              # padding: skipped
    layer_offset, v_offset = 2 * block, block
    rows = torch.randn(arena_rows, head_dim).to(dtype)
    expected = rows.clone()
    keep = write_k_rows >= 0
    k_rows = key[0].transpose(0, 1).reshape(-1, head_dim)[keep]
    v_rows = value[0].transpose(0, 1).reshape(-1, head_dim)[keep]
    expected.index_copy_(0, write_k_rows[keep] + layer_offset, k_rows)
    expected.index_copy_(0, write_k_rows[keep] + layer_offset + v_offset, v_rows)

    write_kv_rows(rows, write_k_rows, layer_offset, v_offset, key, value)
    assert torch.equal(rows, expected)


def test_rejects_what_the_copy_cannot_survive():
    key, value = hf_projections(4, 9, 3, 64, torch.float32)
    rows = torch.zeros(512, 64)
    ids = torch.arange(12, dtype=torch.int64) * 32
    with pytest.raises(ValueError, match="arena's dtype"):
        write_kv_rows(rows.bfloat16(), ids, 0, 16, key, value)
    with pytest.raises(ValueError, match="12 torch.int32 row ids"):
        write_kv_rows(rows, ids.int(), 0, 16, key, value)
    with pytest.raises(ValueError, match="6 torch.int64 row ids for 4 tokens x 3"):
        write_kv_rows(rows, ids[:6], 0, 16, key, value)
    with pytest.raises(ValueError, match=r"key \(1, 3, 4, 64\) and value \(1, 3, 2, 64\) must match"):
        write_kv_rows(rows, ids, 0, 16, key, value[:, :, :2])
    beyond = ids.clone()
    beyond[5] = 512 - 16                                  # its V row (+16) is row 512 of 512
    with pytest.raises(ValueError, match="outside the arena's 512 rows"):
        write_kv_rows(rows, beyond, 0, 16, key, value)
    assert not rows.any()                                 # nothing written by the refused calls


def test_head_dim_strided_views_are_copied_first():
    key, value = hf_projections(3, 4, 2, 8, torch.float32)
    key_t = key.transpose(2, 3).contiguous().transpose(2, 3)   # same values, head_dim no longer contiguous
    rows = torch.zeros(64, 8)
    ids = torch.tensor([0, 2, 4, 6, 8, 10])
    write_kv_rows(rows, ids, 16, 1, key_t, value)
    assert torch.equal(rows[ids + 16], key[0].transpose(0, 1).reshape(-1, 8))
    assert torch.equal(rows[ids + 17], value[0].transpose(0, 1).reshape(-1, 8))
