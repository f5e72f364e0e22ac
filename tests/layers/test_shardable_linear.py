"""ShardableLinear in one process: the shards of every degree reassemble the full Linear (column: concatenated
outputs, row: summed partials), zero-padded MLP chunks change nothing (Gyges eq. 2), and releasing foreign chunks
gives their pages back to the budget."""
import pytest
import torch
import torch.nn.functional as F

from elastic_hf.layers.shard_layout import PaddedLayout, split_units
from elastic_hf.layers.shardable_linear import ShardableLinear
from elastic_hf.memory import MemoryBudget, create_arena
from elastic_hf.native.decode_gemm import decode_gemm_available


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    if not dist.is_initialized():  # a 1-rank gloo world: all_reduce is the identity, partials are summed here
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return dist.group.WORLD


def _make(layout, mode, weight, bias=None, packed=False):
    out_f, in_f = weight.shape
    budget = MemoryBudget(1 << 30)
    arena = create_arena("cpu", layout.nbytes, budget, "weights")
    lin = ShardableLinear(layout, mode, arena, 0, in_f, out_f, weight.dtype, bias, packed=packed)
    return lin, budget


@pytest.mark.parametrize("zero_pad", [False, True])
def test_column_shards_concatenate_to_the_full_output(zero_pad):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(400, 64), torch.randn(400), torch.randn(5, 64)
    layout = PaddedLayout(400, 1, 64, 4, 4096, (1, 2, 4), zero_pad=zero_pad)
    full = F.linear(x, weight, bias)
    for tp in (1, 2, 4):
        parts = []
        for rank in range(tp):
            lin, _ = _make(layout, "column", weight, bias)
            lin.load(weight, layout.shard_chunks(tp, rank))
            lin.set_shard(tp, rank)
            y = lin(x)
            if zero_pad:  # padded columns are exactly zero and get dropped here
                keep = torch.cat([torch.arange(c.num_rows) + sum(p.stored_rows for p in layout.chunks[:i])
                                  for i, c in enumerate(layout.chunks)])
                offset = sum(layout.chunks[i].stored_rows for i in range(layout.shard_chunks(tp, rank)[0]))
                keep = keep[(keep >= offset) & (keep < offset + y.shape[-1])] - offset
                assert torch.all(y[:, [i for i in range(y.shape[-1]) if i not in set(keep.tolist())]] == 0)
                y = y[:, keep]
            parts.append(y)
        torch.testing.assert_close(torch.cat(parts, dim=-1), full, rtol=1e-5, atol=1e-5)


def test_row_shards_sum_to_the_full_output(world):
    torch.manual_seed(1)
    heads, hd, hidden = 3, 8, 32
    weight = torch.randn(hidden, heads * hd)          # o_proj: [hidden, heads * hd]
    x = torch.randn(4, heads * hd)
    layout = PaddedLayout(heads, hd, hidden, 4, 4096, (1, 2), zero_pad=False)
    full = F.linear(x, weight)
    for tp in (1, 2):
        total = torch.zeros_like(full)
        for rank, (lo, hi) in enumerate(split_units(heads, tp)):
            lin, _ = _make(layout, "row", weight)
            lin.load(weight, layout.shard_chunks(tp, rank))
            lin.set_shard(tp, rank, world)
            total += lin(x[:, lo * hd:hi * hd])
        torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_zero_padded_mlp_equals_the_unpadded_mlp():
    torch.manual_seed(2)
    hidden, inter = 64, 400
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(3, hidden)
    layout = PaddedLayout(inter, 1, hidden, 4, 4096, (1, 2, 4), zero_pad=True)
    assert layout.chunks[0].stored_rows > layout.chunks[0].num_rows  # really padded
    mods = []
    for w, mode in ((gate, "column"), (up, "column"), (down, "row")):
        lin, _ = _make(layout, mode, w)
        lin.load(w, list(range(len(layout.chunks))))
        lin.set_shard(1, 0)
        mods.append(lin)
    got = mods[2](F.silu(mods[0](x)) * mods[1](x))
    torch.testing.assert_close(got, F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down),
                               rtol=1e-4, atol=1e-4)


def test_release_returns_pages_and_reload_restores(world):
    torch.manual_seed(3)
    weight = torch.randn(1536, 96)
    layout = PaddedLayout(1536, 1, 96, 4, 4096, (1, 2), zero_pad=True)
    lin, budget = _make(layout, "column", weight)
    lin.load(weight, layout.shard_chunks(1, 0))
    lin.set_shard(1, 0)
    full_bytes = budget.used_bytes("weights")
    x = torch.randn(2, 96)
    before = lin(x)
    lin.set_shard(2, 1)
    freed = lin.release(layout.shard_chunks(2, 0))
    assert freed == layout.chunks[0].nbytes and budget.used_bytes("weights") == full_bytes - freed
    with pytest.raises(ValueError, match="not loaded"):
        lin.set_shard(1, 0)
    lin.load(weight, layout.shard_chunks(2, 0))
    lin.set_shard(1, 0)
    assert budget.used_bytes("weights") == full_bytes
    torch.testing.assert_close(lin(x), before)
    with pytest.raises(ValueError, match="active shard"):
        lin.release([0])


def test_a_receive_that_never_lands_still_gives_its_pages_back():
    """A gather commits a chunk's pages before its bytes arrive (chunk_buffer(commit=True)); when the transfer
    fails before mark_loaded, releasing the chunks the old shard does not own must still decommit them, or a
    reshape's rollback finds the budget full when it re-commits its old KV blocks."""
    weight = torch.randn(1536, 96)
    layout = PaddedLayout(1536, 1, 96, 4, 4096, (1, 2), zero_pad=True)
    lin, budget = _make(layout, "column", weight)
    own = layout.shard_chunks(2, 1)
    lin.load(weight, own)
    lin.set_shard(2, 1)
    before = budget.used_bytes("weights")
    foreign = layout.shard_chunks(2, 0)
    for i in foreign:
        lin.chunk_buffer(i, commit=True)   # the receive buffers of a gather that then fails
    assert budget.used_bytes("weights") == before + sum(layout.chunks[i].nbytes for i in foreign)
    assert lin.held == set(own) | set(foreign) and lin.committed == set(own)
    with pytest.raises(ValueError, match="not loaded"):   # landing bytes are not weights yet
        lin.set_shard(1, 0)
    assert lin.release(sorted(lin.held - set(own))) == sum(layout.chunks[i].nbytes for i in foreign)
    assert budget.used_bytes("weights") == before and lin.held == set(own)
    lin.chunk_buffer(foreign[0], commit=True).copy_(weight[:layout.chunks[foreign[0]].stored_rows])
    lin.mark_loaded(foreign[0])            # a receive that lands is a loaded chunk
    assert lin.committed == set(own) | {foreign[0]} and not lin.landing


needs_decode_gemm = pytest.mark.skipif(not decode_gemm_available(torch.bfloat16),
                                       reason="no native decode GEMM for bf16 on this CPU (AVX-512 BF16)")


def _chunk_bytes(lin, i):
    return lin.chunk_buffer(i).clone()


@needs_decode_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_shards_compute_every_degree_in_their_own_pages_and_leave_plain(world, dtype):
    """Packed chunks: every (tp, rank) shard of a column (q-like, with a bias) and a row (o-like) linear gives
    F.linear's result over its part, from bytes that were permuted where they were committed (same address, same
    pages, not the plain rows); a chunk leaves plain (plain_chunk) and a receiver that packs it on arrival holds
    the very bytes of the sender's chunk."""
    torch.manual_seed(4)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    col_w, col_b = (torch.randn(512, 64) / 8).to(dtype), torch.randn(512).to(dtype)    # 8 units x 64 rows
    row_w = (torch.randn(128, 256) / 16).to(dtype)                                     # [hidden, 4 heads x 64]
    col_lay = PaddedLayout(8, 64, 64, col_w.element_size(), 4096, (1, 2, 4, 8), zero_pad=False)  # 64-row chunks
    row_lay = PaddedLayout(4, 64, 128, row_w.element_size(), 4096, (1, 2, 4), zero_pad=False)
    for rows in (1, 5, 40):
        x_col, x_row = torch.randn(1, rows, 64).to(dtype), torch.randn(1, rows, 256).to(dtype)
        for tp in (1, 2, 4):
            cols, total = [], torch.zeros(1, rows, 128)
            for rank, (lo, hi) in enumerate(split_units(4, tp)):
                col, _ = _make(col_lay, "column", col_w, col_b, packed=True)
                row, _ = _make(row_lay, "row", row_w, packed=True)
                assert col.packed and row.packed
                for lin, w, lay in ((col, col_w, col_lay), (row, row_w, row_lay)):
                    lin.load(w, lay.shard_chunks(tp, rank))
                    lin.set_shard(tp, rank, world)
                cols.append(col(x_col))
                total += row(x_row[..., lo * 64:hi * 64]).float()
            torch.testing.assert_close(torch.cat(cols, dim=-1), F.linear(x_col, col_w, col_b), **tol)
            torch.testing.assert_close(total.to(dtype), F.linear(x_row, row_w), **tol)
    col, _ = _make(col_lay, "column", col_w, col_b, packed=True)
    row, _ = _make(row_lay, "row", row_w, packed=True)
    col.load(col_w, list(range(8)))
    row.load(row_w, [0, 1, 2, 3])
    assert not torch.equal(col.chunk_buffer(1), col_w[64:128])                        # permuted in place
    assert col.plain_chunk(1).is_contiguous()                                         # it goes on the wire
    torch.testing.assert_close(col.plain_chunk(1), col_w[64:128], rtol=0, atol=0)
    torch.testing.assert_close(row.plain_chunk(2), row_w[:, 128:192].t(), rtol=0, atol=0)   # stored transposed
    for sender, lay in ((col, col_lay), (row, row_lay)):
        receiver, _ = _make(lay, sender.mode, col_w if sender is col else row_w, col_b if sender is col else None,
                            packed=True)
        receiver.chunk_buffer(3, commit=True).copy_(sender.plain_chunk(3))                # what a peer sends
        receiver.mark_loaded(3)
        assert torch.equal(_chunk_bytes(receiver, 3), _chunk_bytes(sender, 3))
    with pytest.raises(TypeError, match="multiplies torch"):
        col.set_shard(1, 0)
        col(x_col.to(torch.float16))


def test_shapes_the_kernel_cannot_read_stay_plain():
    weight = torch.randn(400, 64)                     # 400 units of one row: chunks of 200 / 100 rows
    layout = PaddedLayout(400, 1, 64, 4, 4096, (1, 2, 4), zero_pad=False)
    lin, _ = _make(layout, "column", weight, packed=True)
    assert not lin.packed
    lin.load(weight, list(range(len(layout.chunks))))
    assert torch.equal(lin.chunk_buffer(0), weight[:layout.chunks[0].num_rows])


@needs_decode_gemm
def test_packed_shards_back_to_back_share_one_product_at_tp1_only(world):
    """q/k/v-like packed shards placed back to back in one arena share one product at TP1 (the outputs of each
    member unchanged, one GEMM), and compute alone at TP2, where other ranks' chunks lie between them."""
    from elastic_hf.layers.shardable_linear import fuse_shards

    torch.manual_seed(5)
    weights = [torch.randn(rows, 64) / 8 for rows in (256, 128, 128)]     # q: 2 units x 128, k / v: 2 x 64
    biases = [torch.randn(w.shape[0]) for w in weights]
    layouts = [PaddedLayout(2, w.shape[0] // 2, 64, 4, 4096, (1, 2), zero_pad=False) for w in weights]
    arena = create_arena("cpu", sum(lay.nbytes for lay in layouts), MemoryBudget(1 << 30), "weights")
    group, offset = [], 0
    for w, b, lay in zip(weights, biases, layouts):
        lin = ShardableLinear(lay, "column", arena, offset, 64, w.shape[0], torch.float32, b, packed=True)
        lin.load(w, [0, 1])
        lin.set_shard(1, 0)
        group.append(lin)
        offset += lay.nbytes
    x = torch.randn(1, 3, 64)
    alone = [lin(x) for lin in group]
    assert fuse_shards(group) and all(lin.fused is group[0].fused for lin in group)
    assert group[0].fused.product(x).shape == (1, 3, 512)
    for lin, expected, w, b in zip(group, alone, weights, biases):
        torch.testing.assert_close(lin(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for lin in group:
        lin.set_shard(2, 1)
    assert not fuse_shards(group) and all(lin.fused is None for lin in group)
    for lin, w, b in zip(group, weights, biases):
        half = w.shape[0] // 2
        torch.testing.assert_close(lin(x), F.linear(x, w[half:], b[half:]), rtol=1e-5, atol=1e-4)
