"""What a transformers user types works: dtype "auto" is the checkpoint's dtype, transformers' keywords
(torch_dtype, device_map, token) map onto the engine's, the ones it does not take are refused by name, generate
takes max_new_tokens and a GenerationConfig, and generation_config.json supplies the default sampling values
(vLLM's --generation-config auto; vllm turns it off)."""
import json
import shutil

import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def half_checkpoints(tmp_path_factory, tiny_checkpoint):
    """The tiny Llama saved in bfloat16 and in float16."""
    from transformers import AutoModelForCausalLM

    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        path = tmp_path_factory.mktemp(str(dtype).removeprefix("torch."))
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=dtype).save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_checkpoint("llama") / name, path / name)
        out[dtype] = path
    return out


def test_dtype_auto_is_the_checkpoints_own(half_checkpoints, tiny_checkpoint):
    def weight_dtype(model):
        return model.worker.hf_model.model.layers[0].self_attn.q_proj.weight.dtype

    model = ElasticModel.from_pretrained(half_checkpoints[torch.bfloat16], kv_cache_memory=1 << 20)
    assert model.config.dtype == "bfloat16" and weight_dtype(model) == torch.bfloat16
    # float16 on a CPU runs as bfloat16 (vLLM's CPU backend does the same)
    assert ElasticModel.from_pretrained(half_checkpoints[torch.float16], kv_cache_memory=1 << 20).config.dtype == \
        "bfloat16"
    assert ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20).config.dtype == "float32"
    explicit = ElasticModel.from_pretrained(half_checkpoints[torch.bfloat16], kv_cache_memory=1 << 20,
                                            dtype="float")   # vLLM's spelling of float32
    assert explicit.config.dtype == "float32" and weight_dtype(explicit) == torch.float32


def test_transformers_keywords_map_or_are_refused_by_name(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model = ElasticModel.from_pretrained(path, torch_dtype=torch.bfloat16, device_map="auto", token=False,
                                         low_cpu_mem_usage=True, kv_cache_memory=1 << 20)
    assert model.config.dtype == "bfloat16" and model.config.device == "cpu" and model.config.hf_token is False
    with pytest.raises(ValueError, match="attn_implementation is not supported: elastic-hf runs its own paged"):
        ElasticModel.from_pretrained(path, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="quantization_config is not supported"):
        ElasticModel.from_pretrained(path, quantization_config={"load_in_4bit": True})
    with pytest.raises(ValueError, match=r"device_map=\{'': 0\} is not supported"):
        ElasticModel.from_pretrained(path, device_map={"": 0})
    with pytest.raises(ValueError, match="unknown option.* use_flash.*EngineConfig fields.*torch_dtype, device_map"):
        ElasticModel.from_pretrained(path, use_flash=True)
    with pytest.raises(ValueError, match="give dtype or its alias torch_dtype"):
        ElasticModel.from_pretrained(path, dtype="float32", torch_dtype="bfloat16")


def test_generate_takes_max_new_tokens_and_a_generation_config(tiny_checkpoint):
    from transformers import GenerationConfig

    model = ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20)
    prompt = list(range(50, 70))
    greedy = model.generate(prompt, max_tokens=6, ignore_eos=True).outputs[0].token_ids
    assert model.generate(prompt, max_new_tokens=6, ignore_eos=True).outputs[0].token_ids == greedy
    from_config = model.generate(prompt, GenerationConfig(max_new_tokens=6)).outputs[0].token_ids   # greedy
    assert from_config and from_config == greedy[:len(from_config)]   # EOS may end it sooner
    sampled = model.generate(prompt, GenerationConfig(do_sample=True, temperature=5.0, top_k=0,
                                                      max_new_tokens=6, num_return_sequences=3))
    assert len(sampled.outputs) == 3
    # greedy as HF generate reads it: no warpers, but the repetition penalty applies (a logits processor)
    greedy_penalised = model._params(GenerationConfig(repetition_penalty=1.3, top_k=5, max_new_tokens=4), {})
    assert (greedy_penalised.temperature, greedy_penalised.repetition_penalty, greedy_penalised.top_k) == (0.0, 1.3, 0)
    with pytest.raises(ValueError, match=r"GenerationConfig fields \['num_beams'\] are not supported"):
        model.generate(prompt, GenerationConfig(num_beams=4))
    with pytest.raises(ValueError, match="max_tokens or its alias max_new_tokens"):
        model.generate(prompt, max_tokens=3, max_new_tokens=3)


@pytest.fixture(scope="module")
def sampling_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny Llama whose generation_config.json asks for sampling, as chat models' files do."""
    path = tmp_path_factory.mktemp("gen-config") / "llama"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=7, repetition_penalty=1.1, max_new_tokens=9)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_generation_config_supplies_the_default_sampling_values(sampling_checkpoint):
    model = ElasticModel.from_pretrained(sampling_checkpoint, kv_cache_memory=1 << 20)
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 9}
    assert model.deployment.generation_defaults.sampling == want
    assert AsyncEngine(model.engine).default_sampling == want   # what the server's requests default to
    params = model._params(None, {})   # offline: HF generate's reading (do_sample is set: its values)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 7, 9)
    out = model.generate(list(range(50, 70)), ignore_eos=True)
    assert len(out.outputs[0].token_ids) == 9
    plain = ElasticModel.from_pretrained(sampling_checkpoint, kv_cache_memory=1 << 20, generation_config="vllm")
    assert plain.deployment.generation_defaults.sampling == {} and plain._params(None, {}).temperature == 0.0


def test_request_fields_win_over_generation_config_defaults():
    from elastic_hf.serving.protocol import ChatCompletionRequest

    defaults = {"temperature": 0.6, "top_k": 7, "top_p": 0.9}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.0)
    params = req.sampling_params(5, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 7, 0.9)
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert plain.sampling_params(5).temperature == 1.0   # OpenAI's default without a generation config
