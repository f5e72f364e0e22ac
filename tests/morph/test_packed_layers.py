"""A morphing instance's decoder layers on packed weights in their own arena bytes (PlacedWeights.
pack_layers_in_place): every linear of an fp layer reads its packed bytes where the layer's fp range holds them, the
greedy tokens are HF's and an unpacked morphing instance's, the KV cache is as large, and a layer that went to W4
and back gets the packed bytes back bit for bit (the morph store's fp image is taken after packing)."""
from __future__ import annotations

import pytest
import torch

from elastic_hf.layers.packed_linear import FusedMemberLinear, PackedLinear
from elastic_hf.model.loader import load_hf_model
from elastic_hf.native.decode_gemm import decode_gemm_available
from greedy_reference import hf_greedy, mixed_prompts
from morph_helpers import assert_bit_identical, snapshot, tiny_morph_model

pytestmark = pytest.mark.skipif(not decode_gemm_available(torch.float32),
                                reason="no native decode GEMM on this CPU (AVX-512): the layers stay unpacked")
MAX_NEW = 12


def _layer_products(layer):
    """(module, handle of the native kernel) of every linear of a decoder layer that reads packed bytes."""
    products = []
    for module in layer.modules():
        if type(module) is PackedLinear:
            products.append((module, module.direct))
        elif type(module) is FusedMemberLinear and module.column_start == 0:
            products.append((module, module.fused.direct))
    return products


def test_morphing_layers_pack_in_their_arena_range_and_keep_greedy_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    ref, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 4, 5, 40, seed=2)
    expected = [hf_greedy(ref, p, MAX_NEW) for p in prompts]
    runs, kv_blocks = {}, {}
    for packed in ("off", "auto"):
        model = tiny_morph_model(path, packed_weights=packed)
        try:
            runs[packed] = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)]
            kv_blocks[packed] = model.worker.pool.num_blocks
            layers = model.worker.loaded.layers
            if packed == "off":
                assert not any(_layer_products(layer) for layer in layers)
                continue
            weights = model.worker.weights
            base = weights.arena.view(0, (1,), torch.uint8).data_ptr()
            for i, layer in enumerate(layers):
                products = _layer_products(layer)
                # q/k/v and gate/up as one product each, o and down on their own
                assert len(products) == 4, [type(m).__name__ for m, _ in products]
                region = weights.fp_region(i)
                for module, direct in products:
                    assert direct is not None and direct.in_arena
                    assert region.offset <= direct.weight_ptr - base < region.offset + region.nbytes
                    assert module.weight.is_meta   # the permuted bytes are never read as [out, in]
            original = snapshot(model)
            model.morph.to_precision("all", "w4")
            quantized = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)]
            model.morph.to_precision("all", "fp")
            assert_bit_identical(model, original)
            assert [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)] == runs[packed]
            assert quantized != runs[packed]   # the W4 layers really ran
        finally:
            model.close()
    assert runs["auto"] == runs["off"] == expected
    assert kv_blocks["auto"] == kv_blocks["off"]
