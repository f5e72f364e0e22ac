"""ShardableLinear in one process: the shards of every degree reassemble the full Linear (column: concatenated
outputs, row: summed partials), zero-padded MLP chunks change nothing (Gyges eq. 2), and releasing foreign chunks
gives their pages back to the budget."""
import pytest
import torch
import torch.nn.functional as F

from elastic_hf.layers.shard_layout import PaddedLayout, split_units
from elastic_hf.layers.shardable_linear import ShardableLinear
from elastic_hf.memory import MemoryBudget, create_arena


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    if not dist.is_initialized():  # a 1-rank gloo world: all_reduce is the identity, partials are summed here
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return dist.group.WORLD


def _make(layout, mode, weight, bias=None):
    out_f, in_f = weight.shape
    budget = MemoryBudget(1 << 30)
    arena = create_arena("cpu", layout.nbytes, budget, "weights")
    lin = ShardableLinear(layout, mode, arena, 0, in_f, out_f, torch.float32, bias)
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
