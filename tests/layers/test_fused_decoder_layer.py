"""The fused decoder-layer forward (layers/fused_decoder_layer.py): switched in for Llama, Qwen2 and Mistral layers
on the CPU, it gives HF's greedy tokens, and the engine's logits equal those of the same engine on HF's own layer
forward bit for bit, on plain linears, on packed ones (one q/k/v GEMM) and after a precision morph (quantized
linears sit in the layer); `fused_layers="off"` leaves HF's forward; a layer it does not take keeps HF's."""
import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.layers.fused_decoder_layer import FusedDecoderLayer, fusable_layer, use_fused_layers
from elastic_hf.layers.packed_linear import FusedMemberLinear
from elastic_hf.model.loader import load_hf_model
from greedy_reference import hf_greedy, mixed_prompts, step_logits

MAX_NEW = 8


def _layers(model):
    return model.worker.loaded.layers


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_layers_give_hf_greedy_tokens(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    ref, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 5, 4, 40, seed=7)
    with ElasticModel.from_pretrained(path, kv_cache_memory=4 << 20, max_num_batched_tokens=32) as model:
        layers = _layers(model)
        assert all(isinstance(layer, FusedDecoderLayer) for layer in layers)
        got = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)]
    assert got == [hf_greedy(ref, p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """fp32 packs only weights of >= 576*576 elements: a wide layer so that q/k/v become one packed product."""
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("fused") / "wide", 0, hidden_size=576,
                                 intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                                 num_key_value_heads=3, tie_word_embeddings=True)


@pytest.mark.parametrize("packed", ["off", "auto"])
def test_fused_forward_is_bit_identical_to_hfs(wide_llama, packed):
    _, tokenizer = load_hf_model(wide_llama)
    prompts = mixed_prompts(tokenizer, 4, 3, 50, seed=2)
    logits = {}
    for mode in ("off", "auto", "on"):   # on the CPU, on is auto
        with ElasticModel.from_pretrained(wide_llama, kv_cache_memory=4 << 20, max_num_batched_tokens=24,
                                          packed_weights=packed, fused_layers=mode) as model:
            layers = _layers(model)
            assert all(isinstance(layer, FusedDecoderLayer) == (mode != "off") for layer in layers)
            if packed == "auto":
                assert isinstance(layers[0].self_attn.q_proj, FusedMemberLinear)
            logits[mode] = step_logits(model, prompts, MAX_NEW)
    assert len(logits["off"]) == len(logits["auto"]) == len(logits["on"]) > 0
    for a, b, c in zip(logits["off"], logits["auto"], logits["on"]):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_fused_forward_runs_the_morphed_linears(tiny_checkpoint):
    """After morphing layers to W8 the fused layer calls the quantized linears: the same logits as HF's forward over
    the same morphed model."""
    path = tiny_checkpoint("llama")
    _, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 3, 4, 30, seed=5)
    logits = {}
    for mode in ("off", "auto"):
        with ElasticModel.from_pretrained(path, kv_cache_memory=4 << 20, morph="manual", fused_layers=mode,
                                          morph_options={"precisions": ("w8",)}) as model:
            model.morph.to_precision([0, 1], "w8")
            assert all(isinstance(layer, FusedDecoderLayer) == (mode == "auto") for layer in _layers(model))
            logits[mode] = step_logits(model, prompts, MAX_NEW)
    for a, b in zip(logits["off"], logits["auto"]):
        assert torch.equal(a, b)


def test_a_layer_of_another_formula_is_not_switched():
    from tiny_models import tiny_hf_model

    qwen3 = tiny_hf_model("qwen3", 0)   # q/k norms inside the attention: HF's forward
    assert not fusable_layer(qwen3.model.layers[0])
    assert use_fused_layers(qwen3.model.layers, "transformers.models.qwen3.modeling_qwen3",
                            "apply_rotary_pos_emb") == 0
    llama = tiny_hf_model("llama", 0)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert use_fused_layers(llama.model.layers, "transformers.models.llama.modeling_llama", None) == 0
    assert use_fused_layers(llama.model.layers, "transformers.models.llama.modeling_llama",
                            "apply_rotary_pos_emb") == len(llama.model.layers)
    # outside an engine step (no paged batch) the switched layer runs HF's forward: plain generate is unchanged
    with torch.inference_mode():
        after = llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(before, after)
