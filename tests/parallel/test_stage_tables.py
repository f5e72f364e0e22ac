"""The vocabulary tables a pipeline stage holds (parallel/stage_tables.py): a first stage that is not the last gives
its table back and embeds from the host store's rows, a later stage holds no embedding, only the last stage holds
the head; given back and refilled (plain or packed in place, tied or not), every output is bit-identical, and the
committed bytes move by exactly the tables' pages. In-process, on a page arena and a store of the tables."""
import pytest
import torch
from torch import nn

from elastic_hf.layers.host_rows_embedding import HostRowsEmbedding
from elastic_hf.layers.packed_table import PackedEmbedding, pack_head_in_place
from elastic_hf.memory import MemoryBudget, create_arena
from elastic_hf.native.decode_gemm import decode_gemm_available
from elastic_hf.parallel.stage_tables import StageTables
from tiny_models import tiny_hf_model

NUM_LAYERS = 4
PAGE = 4096


class TableStore:
    """The part of SharedWeightStore a StageTables reads: the checkpoint's tables (a tied model has no head)."""

    def __init__(self, model, tied: bool):
        self.tables = {"embed_tokens": model.get_input_embeddings().weight.detach().clone()}
        if not tied:
            self.tables["lm_head"] = model.get_output_embeddings().weight.detach().clone()

    def table(self, name):
        return self.tables.get(name)


def _placed(tied: bool, packed: bool):
    model = tiny_hf_model("llama", num_hidden_layers=NUM_LAYERS, tie_word_embeddings=tied, vocab_size=1024)
    store = TableStore(model, tied)
    budget = MemoryBudget(64 << 20)
    arena = create_arena("cpu", StageTables.extent(model, PAGE), budget, "weights", PAGE)
    tables = StageTables(model, arena, 0, store, torch.device("cpu"))
    if packed and not pack_head_in_place(model):
        pytest.skip("the native decode GEMM is not built for this CPU")
    return model, tables, arena


def _outputs(model):
    ids = torch.tensor([5, 17, 1000, 3])
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    return model.get_input_embeddings()(ids), model.get_output_embeddings()(hidden)


@pytest.mark.parametrize("tied,packed", [(True, False), (False, False), (True, True), (False, True)])
def test_stage_roles_hold_only_the_tables_they_read_and_compute_the_same(tied, packed):
    if packed and not decode_gemm_available(torch.float32):
        pytest.skip("the native decode GEMM is not built for this CPU")
    model, tables, arena = _placed(tied, packed)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows, logits = _outputs(model)
    table_bytes = tables.total_bytes // (1 if tied else 2)
    whole = (0, NUM_LAYERS)
    assert tables.held_bytes(NUM_LAYERS, whole) == tables.total_bytes == arena.committed_bytes

    # The first stage of two: no table in the arena, the embedding reads the store's rows.
    released = tables.release((0, 2), NUM_LAYERS)
    assert released == tables.total_bytes and arena.committed_bytes == 0
    assert type(embedding) is HostRowsEmbedding
    assert torch.equal(embedding(torch.tensor([5, 17, 1000, 3])), rows)
    assert head.weight.is_meta and (not tied or embedding.weight is head.weight)

    # The last stage: the head only (a tied table serves as both).
    loaded, released = tables.apply((2, NUM_LAYERS), NUM_LAYERS)
    assert loaded == table_bytes and released == 0 and arena.committed_bytes == table_bytes
    assert torch.equal(head(torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(0))),
                       logits)
    assert tables.held_bytes(NUM_LAYERS) == tables.held_bytes(NUM_LAYERS, (2, NUM_LAYERS)) == table_bytes

    # Back to the whole model (a restore): every table refilled, the embedding reads the arena again.
    loaded, _ = tables.apply(whole, NUM_LAYERS)
    assert arena.committed_bytes == tables.total_bytes
    assert type(embedding) is (PackedEmbedding if tied and packed else nn.Embedding)
    assert (tied and packed) or embedding.weight.data_ptr() == arena.view(0, (1,), torch.float32).data_ptr()
    assert (embedding.weight is head.weight) == tied
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), (rows, logits)))


def test_a_middle_stage_holds_no_table_and_a_table_without_a_store_copy_stays():
    model, tables, arena = _placed(tied=False, packed=False)
    assert tables.held_bytes(NUM_LAYERS, (1, 3)) == 0   # neither embeds nor runs the head
    # Prepare gives back what the new role does not read and keeps what both roles read until the switch.
    assert tables.held_bytes(NUM_LAYERS, (0, NUM_LAYERS), (2, NUM_LAYERS)) == tables.total_bytes // 2
    del tables.store.tables["lm_head"]                   # a checkpoint without the head's own tensor
    model2 = tiny_hf_model("llama", num_hidden_layers=NUM_LAYERS, vocab_size=1024)
    arena2 = create_arena("cpu", StageTables.extent(model2, PAGE), MemoryBudget(64 << 20), "weights", PAGE)
    kept = StageTables(model2, arena2, 0, tables.store, torch.device("cpu"))
    assert kept.release((0, 2), NUM_LAYERS) == kept.total_bytes // 2   # the embedding went, the head stays
    assert arena2.committed_bytes == kept.total_bytes // 2


def test_a_scaled_embedding_keeps_its_table_on_the_first_stage():
    """Gemma's embedding multiplies its rows: the store's raw rows are not its output, so it keeps its own."""
    model = tiny_hf_model("gemma2", num_hidden_layers=NUM_LAYERS, vocab_size=1024, tie_word_embeddings=True)
    store = TableStore(model, tied=True)
    arena = create_arena("cpu", StageTables.extent(model, PAGE), MemoryBudget(64 << 20), "weights", PAGE)
    tables = StageTables(model, arena, 0, store, torch.device("cpu"))
    assert not tables.host_rows
    assert tables.release((0, 2), NUM_LAYERS) == 0 and arena.committed_bytes == tables.total_bytes
    assert tables.release((2, NUM_LAYERS), NUM_LAYERS) == 0   # a tied table is the last stage's head
    assert tables.held_bytes(NUM_LAYERS, (1, 3)) == 0


@pytest.mark.parametrize("tied", [True, False])
def test_the_host_store_holds_the_checkpoints_tables(tmp_path, tied):
    """The shared host weight store reads the embedding (and an untied head) beside the decoder linears: what a
    first stage's rows and a refilled table come from."""
    from elastic_hf.parallel.weight_store import SharedWeightStore
    from elastic_hf.patches import get_adapter
    from tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama", tmp_path / "ckpt", 0, num_hidden_layers=2, vocab_size=1024,
                                 tie_word_embeddings=tied)
    model = tiny_hf_model("llama", 0, num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=tied)
    store = SharedWeightStore.from_checkpoint(path, get_adapter(model.config), 2, torch.float32, shared=False)
    assert torch.equal(store.table("embed_tokens"), model.get_input_embeddings().weight)
    if tied:
        assert store.table("lm_head") is None   # the file holds the one table under the embedding's name
    else:
        assert torch.equal(store.table("lm_head"), model.get_output_embeddings().weight)
    assert torch.equal(store.get(1, "down"), model.model.layers[1].mlp.down_proj.weight)
