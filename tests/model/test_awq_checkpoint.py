"""A pre-quantized AWQ checkpoint in AutoAWQ's GEMM layout, written here from our own AWQ (scales searched and
folded per layer, then AutoAWQ's integer-zero quantizer), loads into W4 layers holding exactly the file's 4-bit
values (no de-quantize), in the weights arena the budget counts, and generates the greedy tokens of the same W4
model built in memory; morphing and sharding are refused (no full-precision source)."""
import copy
import json

import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.layers.awq import fold_awq_scales, search_awq_scales
from elastic_hf.layers.awq_format import from_awq_gemm, quantize_awq_gemm
from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.quantize_layer import decoder_layer_kwargs
from elastic_hf.layers.w4_linear import W4Linear
from elastic_hf.patches import get_adapter
from greedy_reference import hf_greedy

GROUP = 32


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    """(checkpoint dir, the in-memory W4 reference model, {linear name: (q, scales, zeros)})."""
    from safetensors.torch import save_file

    from tiny_models import minimal_tokenizer, tiny_hf_model

    model = tiny_hf_model("qwen2", num_hidden_layers=2, vocab_size=512, max_position_embeddings=512)  # q/k/v biases
    adapter = get_adapter(model.config)
    torch.manual_seed(0)
    hidden = model.model.embed_tokens(torch.randint(0, 512, (2, 32))).float()   # calibration input [2, 32, 64]
    kwargs = decoder_layer_kwargs(model, 2, 32)
    reference = copy.deepcopy(model)
    state, values = {}, {}
    for i, layer in enumerate(model.model.layers):
        scales, hidden = search_awq_scales(layer, adapter, model.config, hidden, kwargs,
                                           QuantScheme.create("w4", GROUP, method="awq"))
        folded = reference.model.layers[i]
        fold_awq_scales(folded, adapter, model.config, scales)   # our AWQ: scales folded into the norms
        for name in adapter.linear_names():
            linear = folded.get_submodule(name)
            key = f"model.layers.{i}.{name}"
            qweight, qzeros, s = quantize_awq_gemm(linear.weight.data, GROUP)
            state.update({f"{key}.qweight": qweight, f"{key}.qzeros": qzeros, f"{key}.scales": s})
            if linear.bias is not None:
                state[f"{key}.bias"] = linear.bias.data.clone()
            values[key] = from_awq_gemm(qweight, qzeros, s, GROUP)
            parent, _, attr = name.rpartition(".")
            setattr(folded.get_submodule(parent), attr,
                    W4Linear.from_quantized(*values[key], GROUP, linear.bias.data if linear.bias is not None else None))
    quantized = set(values)
    for name, tensor in reference.state_dict().items():   # the rest: embeddings, folded norms, LM head
        if name.rpartition(".")[0] not in quantized:
            state[name] = tensor.contiguous()
    path = tmp_path_factory.mktemp("awq") / "qwen2-awq"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    (path / "config.json").write_text(json.dumps(config))
    minimal_tokenizer(512).save_pretrained(path)
    return path, reference.eval(), values


def test_awq_checkpoint_loads_the_files_values_and_matches_the_w4_model(awq_checkpoint):
    path, reference, values = awq_checkpoint
    model = ElasticModel.from_pretrained(path, kv_cache_memory=2 << 20, max_num_batched_tokens=32)
    hf_model = model.worker.hf_model
    arena = model.worker.weights.arena
    base = arena.view(0, (1,), torch.uint8).data_ptr()
    for key, (q, scales, zeros) in values.items():
        layer = hf_model.get_submodule(key)
        assert isinstance(layer, W4Linear)
        got_q, got_scales, got_zeros = layer.quantized_values()
        assert torch.equal(got_q, q) and torch.equal(got_scales, scales) and torch.equal(got_zeros, zeros), key
        assert 0 <= layer.weight_packed.data_ptr() - base < arena.capacity_bytes   # in the budgeted arena
    for i, placed in enumerate(model.worker.weights.placement.layers):   # W4 in the ledger, not de-quantized fp32
        fp32_bytes = 4 * sum(m.in_features * m.out_features for k, m in values_modules(hf_model, values, i))
        assert placed.payload_bytes < 0.3 * fp32_bytes
    prompts = [list(range(10, 60)), [7, 8, 9], list(range(100, 140))]   # 50 tokens: chunked prefill at 32
    for prompt, out in zip(prompts, model.generate(prompts, max_tokens=10)):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 10)


def values_modules(hf_model, values, layer_index):
    return [(k, hf_model.get_submodule(k)) for k in values if k.startswith(f"model.layers.{layer_index}.")]


def test_awq_checkpoint_refuses_morphing_and_sharding(awq_checkpoint):
    path = awq_checkpoint[0]
    with pytest.raises(ValueError, match="4-bit weights only, with no full-precision source to morph up to"):
        ElasticModel.from_pretrained(path, kv_cache_memory=2 << 20, morph="manual")
    with pytest.raises(ValueError, match="no full-precision source to shard"):
        ElasticModel.from_pretrained(path, kv_cache_memory=2 << 20, workers=2)
