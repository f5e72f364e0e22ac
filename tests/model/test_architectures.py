"""Every family of patches/ (and, through the generic adapter, a model type without an entry) serves HF's exact
greedy tokens: concurrent prompts of mixed lengths, chunked prefill, windows exceeded (Mistral, Gemma), soft-capped
scores (Gemma 2), partial rotary (Phi-3), multipliers (Granite), experts (Qwen3-MoE, Mixtral)."""
import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.model.loader import load_hf_model
from greedy_reference import hf_greedy, mixed_prompts
from tiny_models import TINY_ARCHS

MAX_NEW = 12


# The fast tier runs the families whose attention or layers differ most (windows, soft-cap, fused Linears,
# experts); the full suite all of them.
FAST = ("llama", "gemma3_text", "gemma2", "phi3", "qwen3_moe")


@pytest.mark.parametrize("arch", [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in TINY_ARCHS])
def test_family_matches_hf_with_chunked_prefill(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    reference, _ = load_hf_model(path)
    # A 48-token step budget splits every prompt longer than that into chunks sharing steps with decodes; prompts
    # up to 100 tokens pass the 24-token windows, so windowed decodes sit beside batched ones.
    model = ElasticModel.from_pretrained(path, max_num_batched_tokens=48, kv_cache_memory=16 << 20)
    prompts = mixed_prompts(model.tokenizer, 8, 3, 100, seed=1)
    outputs = model.generate(prompts, max_tokens=MAX_NEW)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, MAX_NEW), f"{len(prompt)}-token prompt"
    assert model.engine.num_steps > MAX_NEW   # chunking really happened
    assert model.memory_report()["kv_blocks_used"] == 0


def test_gemma3_layers_attend_with_their_own_window(tiny_checkpoint):
    """The windows come from each layer: Gemma 3's sliding layers see 24 tokens, its global layers everything."""
    model = ElasticModel.from_pretrained(tiny_checkpoint("gemma3_text"), kv_cache_memory=4 << 20)
    attention = model.worker.instance.loaded.layer_attention
    assert attention.windows == (24, None, 24) and attention.softcap is None
    gemma2 = ElasticModel.from_pretrained(tiny_checkpoint("gemma2"), kv_cache_memory=4 << 20)
    assert gemma2.worker.instance.loaded.layer_attention.softcap == 20.0


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tiny_models import minimal_tokenizer

    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, initializer_range=0.3, bos_token_id=1,
                        eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    minimal_tokenizer(100).save_pretrained(path)
    return path


def test_a_model_type_without_an_entry_serves_through_the_generic_adapter(gpt2_checkpoint):
    """GPT-2 (transformer.h, Conv1D projections, learned positions): HF's own forward with our paged attention
    gives its exact tokens; the elastic operations that need Llama's Linears are refused by name."""
    reference, _ = load_hf_model(gpt2_checkpoint)
    model = ElasticModel.from_pretrained(gpt2_checkpoint, kv_cache_memory=4 << 20, max_num_batched_tokens=16)
    prompts = [list(range(5, 40)), [30, 31, 32]]
    for prompt, out in zip(prompts, model.generate(prompts, max_tokens=10)):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 10)
    with pytest.raises(ValueError, match="no nn.Linear self_attn.q_proj"):
        ElasticModel.from_pretrained(gpt2_checkpoint, kv_cache_memory=4 << 20, morph="manual")
    with pytest.raises(ValueError, match="2 workers shards the weights"):
        ElasticModel.from_pretrained(gpt2_checkpoint, kv_cache_memory=4 << 20, workers=2)
