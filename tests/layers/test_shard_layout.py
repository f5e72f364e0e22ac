"""The padded shard layout: every shard of every allowed degree is a run of page-aligned chunks; uneven head
splits; the padding overhead report."""
import pytest

from elastic_hf.layers.shard_layout import (ModelShardSpec, PaddedLayout, allowed_tp_degrees, padding_overhead,
                                            split_units)

SMOLLM = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64, itemsize=4)


def test_split_units_is_uneven_when_needed():
    assert split_units(3, 2) == [(0, 2), (2, 3)]
    assert split_units(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_units(1536, 2) == [(0, 768), (768, 1536)]
    with pytest.raises(ValueError, match=r"tp must be in \[1, 3\]"):
        split_units(3, 4)


def test_allowed_degrees_need_a_kv_head_per_rank():
    assert allowed_tp_degrees(2, 3) == (1, 2)
    assert allowed_tp_degrees(4, 3) == (1, 2)
    assert allowed_tp_degrees(4, 4) == (1, 2, 4)


@pytest.mark.parametrize("page_size", [4096, 1 << 21])
@pytest.mark.parametrize("kind", ["q", "k", "v", "o", "gate", "up", "down"])
def test_every_shard_starts_on_a_page(kind, page_size):
    spec = ModelShardSpec(**SMOLLM, page_size=page_size, degrees=(1, 2))
    lay = spec.layout(kind)
    for c in lay.chunks:
        assert c.byte_offset % page_size == 0 and c.nbytes % page_size == 0
        assert c.stored_rows * lay.row_bytes <= c.nbytes
    for tp in spec.degrees:
        owned = [lay.shard_chunks(tp, r) for r in range(tp)]
        assert sorted(i for ids in owned for i in ids) == list(range(len(lay.chunks)))  # a partition
        for ids in owned:
            assert ids == list(range(ids[0], ids[-1] + 1))  # contiguous chunks


def test_zero_padding_keeps_mlp_runs_contiguous():
    # 256-byte rows fill 4 KiB pages in 16-row multiples: 100 neurons per TP4 chunk are stored as 112 rows.
    lay = PaddedLayout(400, 1, 64, 4, 4096, (1, 2, 4), zero_pad=True)
    assert [c.stored_rows for c in lay.chunks] == [112] * 4
    assert len(lay.runs(lay.shard_chunks(1, 0))) == 1  # TP1 is one GEMM over the padded weight
    unpadded = PaddedLayout(400, 1, 64, 4, 4096, (1, 2, 4), zero_pad=False)
    assert len(unpadded.runs(unpadded.shard_chunks(1, 0))) == 4  # gaps: attention-style segments
    wide = PaddedLayout(400, 1, 576, 4, 4096, (1, 2, 4), zero_pad=True)  # 12 zero rows would cost 6.75 pages
    assert [c.stored_rows for c in wide.chunks] == [100] * 4


def test_padding_overhead_report():
    cpu = padding_overhead(ModelShardSpec(**SMOLLM, page_size=4096, degrees=(1, 2)), 30)
    gpu = padding_overhead(ModelShardSpec(**SMOLLM, page_size=1 << 21, degrees=(1, 2)), 30)
    assert cpu["overhead_bytes"] == 0  # SmolLM's head and neuron rows fill 4 KiB pages exactly
    assert 0 < gpu["overhead_fraction"] < 1.0  # 2 MiB VMM pages cost a lot on a 135M model (about 59 %)
    assert gpu["padded_bytes"] >= gpu["payload_bytes"]
