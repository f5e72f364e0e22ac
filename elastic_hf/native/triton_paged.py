"""The paged KV cache's GPU kernels, in Triton: the write of a step's new K/V rows into their pages and decode
attention that reads every sequence's K/V in place from its pages (no gather of the context into a padded tensor).

Both take their sizes from device tensors, never from host values that change step to step, and neither syncs with
the host, so a decode step built on them can be captured once as a CUDA graph and replayed (model/cuda_graphs.py).
The CPU has its C kernels (paged_decode.c); Triton is optional: without it the attention falls back to torch ops."""
from __future__ import annotations

from functools import cache

import torch

from elastic_hf.units import ceil_div


@cache
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def triton_tile_shapes_ok(head_dim: int, block_size: int) -> bool:
    """The kernels' tiles are [block_size, head_dim]: Triton needs both powers of two."""
    return head_dim > 0 and block_size > 0 and not (head_dim & (head_dim - 1) or block_size & (block_size - 1))


def triton_paged_available(device: torch.device, head_dim: int, block_size: int) -> bool:
    """The kernels run on CUDA with Triton for triton_tile_shapes_ok shapes; other shapes take the torch path
    (index_copy_ writes, gathered SDPA decodes) and step without graphs."""
    return device.type == "cuda" and triton_tile_shapes_ok(head_dim, block_size) and _triton() is not None


@cache
def _kernels():
    triton, tl = _triton()

    @triton.jit
    def kv_write(rows_ptr, write_rows_ptr, k_ptr, v_ptr, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                 layer_offset, v_offset, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
        # one program per (new token, kv head); a negative row is a padding slot of a captured batch: skipped
        i = tl.program_id(0)
        token, head = i // NUM_KV_HEADS, i % NUM_KV_HEADS
        row = tl.load(write_rows_ptr + i)
        if row >= 0:
            d = tl.arange(0, HEAD_DIM)
            k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + d)
            v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + d)
            dst = (row + layer_offset) * HEAD_DIM
            tl.store(rows_ptr + dst + d, k)
            tl.store(rows_ptr + dst + v_offset * HEAD_DIM + d, v)

    @triton.jit
    def decode(q_ptr, q_stride_s, q_stride_h, kv_ptr, table_ptr, max_blocks, layer_chunk_offset, lens_ptr,
               out_ptr, out_stride_s, out_stride_h, part_ptr, stat_ptr, blocks_per_split, scale,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
               SPLIT: tl.constexpr):
        # one program per (sequence, kv head, split of the context): the GROUP query heads sharing that KV head read
        # each K/V block once. Online softmax over the split's blocks, fp32 throughout. Unsplit, the output is
        # rounded once here; split, the partial (max, sum, accumulator) goes to `combine`.
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_kv_heads, num_splits = tl.num_programs(1), tl.num_programs(2)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK)
        heads = kv_head * GROUP + g
        live = g < GROUP
        q = tl.load(q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + d[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32) * scale                                       # [G, D]
        length = tl.load(lens_ptr + seq)
        k_table = table_ptr + (seq * num_kv_heads + kv_head) * 2 * max_blocks             # K chunks, then V chunks
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        s = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        first = split * blocks_per_split
        last = tl.minimum(tl.cdiv(length, BLOCK), first + blocks_per_split)
        for j in range(first, last):
            k_chunk = tl.load(k_table + j) + layer_chunk_offset
            v_chunk = tl.load(k_table + max_blocks + j) + layer_chunk_offset
            k = tl.load(kv_ptr + k_chunk * (BLOCK * HEAD_DIM) + t[:, None] * HEAD_DIM + d[None, :]).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                        # [G, BLOCK]
            scores = tl.where((j * BLOCK + t)[None, :] < length, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])                                             # [G, BLOCK]
            s = s * alpha + tl.sum(p, axis=1)
            v = tl.load(kv_ptr + v_chunk * (BLOCK * HEAD_DIM) + t[:, None] * HEAD_DIM + d[None, :]).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)    # [G, D]
            m = m_new
        if SPLIT:
            # partials [S, num_heads, num_splits, D] and stats [S, num_heads, num_splits, 2] (max, sum)
            slot = (seq * num_kv_heads * GROUP + heads) * num_splits + split                  # [G]
            tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=live[:, None])
            tl.store(stat_ptr + slot * 2, m, mask=live)
            tl.store(stat_ptr + slot * 2 + 1, s, mask=live)
        else:
            out = tl.where(s[:, None] > 0, acc / s[:, None], 0.0)   # a padding row (length 0) gives zeros
            tl.store(out_ptr + seq * out_stride_s + heads[:, None] * out_stride_h + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def combine(part_ptr, stat_ptr, out_ptr, out_stride_s, out_stride_h, num_splits,
                SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        # one program per (sequence, query head): the splits' partial softmaxes rescaled to the common maximum
        seq, head = tl.program_id(0), tl.program_id(1)
        num_heads = tl.num_programs(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        live = sp < num_splits
        slot = (seq * num_heads + head) * num_splits + sp
        m = tl.load(stat_ptr + slot * 2, mask=live, other=float("-inf"))
        s = tl.load(stat_ptr + slot * 2 + 1, mask=live, other=0.0)
        acc = tl.load(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
        top = tl.max(m, axis=0)
        weight = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)   # a split past the context saw no key
        total = tl.sum(weight * s, axis=0)
        out = tl.sum(weight[:, None] * acc, axis=0)
        out = tl.where(total > 0, out / total, 0.0)
        tl.store(out_ptr + seq * out_stride_s + head * out_stride_h + d, out.to(out_ptr.dtype.element_ty))

    return kv_write, decode, combine


def paged_kv_write(rows: torch.Tensor, write_k_rows: torch.Tensor, layer_offset: int, v_offset: int,
                   key: torch.Tensor, value: torch.Tensor) -> None:
    """Write the new tokens' K and V into their pages.

    rows:         [arena rows, head_dim] (KVPagePool.rows), on the GPU
    write_k_rows: [T * kv_heads] int64, token-major: the K row of (token, kv head) for layer 0, or -1 to skip
    key, value:   [1, kv_heads, T, head_dim] (HF's projections after the rotary; any strides with head_dim dense)"""
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton KV write needs a power-of-two head_dim, got {head_dim}")
    if key.stride(3) != 1 or value.stride(3) != 1:
        key, value = key.contiguous(), value.contiguous()
    kv_write, _, _ = _kernels()
    kv_write[(write_k_rows.numel(),)](rows, write_k_rows, key, value, key.stride(2), key.stride(1),
                                       value.stride(2), value.stride(1), layer_offset, v_offset,
                                       NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim)


def paged_decode_attention_triton(q: torch.Tensor, kv_chunks: torch.Tensor, chunk_table: torch.Tensor,
                                  layer_chunk_offset: int, ctx_lens: torch.Tensor, out: torch.Tensor,
                                  num_kv_heads: int, scale: float) -> None:
    """The GPU twin of native/paged_decode.paged_decode_attention, same arguments:

    q:           [S, num_heads, head_dim], head_dim contiguous
    kv_chunks:   [num_chunks, block_size, head_dim], contiguous (KVPagePool.chunks)
    chunk_table: [S * num_kv_heads * 2 * max_blocks] int64: layer-0 chunk ids ordered (seq, kv head, K/V, block);
                 only the first ceil(ctx_len / block_size) blocks of a row are read
    ctx_lens:    [S] int64; 0 marks a padding row (its output is zeros)
    out:         [S, num_heads, head_dim], head_dim contiguous"""
    num_seqs, num_heads, head_dim = q.shape
    block_size = kv_chunks.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if not triton_tile_shapes_ok(head_dim, block_size):
        raise ValueError(f"the Triton decode kernel needs power-of-two head_dim and block_size, got {head_dim} "
                         f"and {block_size}")
    if q.stride(2) != 1:
        q = q.contiguous()
    max_blocks = chunk_table.numel() // max(1, num_seqs * num_kv_heads * 2)
    group = num_heads // num_kv_heads
    _, decode, combine = _kernels()
    next_power_of_2 = _triton()[0].next_power_of_2
    splits = _num_splits(q.device, num_seqs * num_kv_heads, max_blocks)
    blocks_per_split = ceil_div(max_blocks, splits)
    splits = ceil_div(max_blocks, blocks_per_split)
    meta = dict(GROUP=group, GROUP_PAD=next_power_of_2(group), BLOCK=block_size, HEAD_DIM=head_dim)
    if splits == 1:
        decode[(num_seqs, num_kv_heads, 1)](q, q.stride(0), q.stride(1), kv_chunks, chunk_table, max_blocks,
                                            layer_chunk_offset, ctx_lens, out, out.stride(0), out.stride(1), out, out,
                                            max_blocks, scale, SPLIT=False, **meta)
        return
    part = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)   # (max, sum)
    decode[(num_seqs, num_kv_heads, splits)](q, q.stride(0), q.stride(1), kv_chunks, chunk_table, max_blocks,
                                             layer_chunk_offset, ctx_lens, out, out.stride(0), out.stride(1), part,
                                             stats, blocks_per_split, scale, SPLIT=True, **meta)
    combine[(num_seqs, num_heads)](part, stats, out, out.stride(0), out.stride(1), splits,
                                   SPLITS_PAD=next_power_of_2(splits), HEAD_DIM=head_dim)


MIN_BLOCKS_PER_SPLIT = 4   # 64 tokens at block_size 16: below that a split's fixed cost outweighs its keys


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(device: torch.device, programs: int, max_blocks: int) -> int:
    """Splits of each context so the grid fills the GPU about twice over (flash-decoding): a batch of 1 over 4,000
    tokens has only num_kv_heads (sequence, kv head) programs otherwise, each walking 250 blocks alone. A function
    of the shapes only, so a captured graph keeps its split."""
    want = ceil_div(2 * _multiprocessors(device), max(programs, 1))
    return max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT))
