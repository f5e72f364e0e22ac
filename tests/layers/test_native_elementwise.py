"""The native fused elementwise kernels (native/fused_elementwise.c) and the modules that run on them
(layers/native_norm.py, layers/swiglu_mlp.py): HF's own RMSNorm and MLP of every supported architecture give the
same results (bf16: bit-identical but for rare one-ulp rounding ties; fp32: to float rounding), for decode and
prefill shapes and strided inputs; only what the kernels take is switched; an engine built on them keeps HF's
greedy tokens with every norm and MLP switched."""
import pytest
import torch
import torch.nn.functional as F

from elastic_hf import ElasticModel
from elastic_hf.layers.native_norm import NativeRMSNorm, use_native_norms
from elastic_hf.layers.packed_linear import bf16_packing_available, pack_fused, packing_available
from elastic_hf.layers.swiglu_mlp import SwiGLUMLP, use_swiglu_mlps
from elastic_hf.native.fused_elementwise import native_elementwise_available, rms_norm, silu_and_mul
from elastic_hf.model.loader import load_hf_model
from elastic_hf.patches import get_adapter
from greedy_reference import hf_greedy, mixed_prompts
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.skipif(not native_elementwise_available(torch.float32, torch.device("cpu")),
                                reason="no C compiler (or ELASTIC_HF_NATIVE=0): the eager modules stay")

ARCHS = ("llama", "qwen2", "mistral")
DTYPES = (torch.float32, torch.bfloat16)
MAX_NEW = 10


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16: the kernel rounds where torch rounds, so all but rare ties (a sum of squares taken in another order
    moving a value across a rounding boundary) are bit-identical, and those differ by one bf16 ulp. fp32: equal up
    to float rounding (the same sum in another order)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if got.dtype == torch.bfloat16:
        differ = got != expected
        assert differ.float().mean() <= 1e-3, f"{int(differ.sum())} of {got.numel()} bf16 values differ"
        ulp = expected.float().abs() * 2.0 ** -7 + 1e-30
        assert ((got.float() - expected.float()).abs() <= ulp).all()
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_hf_norm(arch, dtype):
    torch.manual_seed(0)
    model = tiny_hf_model(arch, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                          num_key_value_heads=3, num_hidden_layers=1, vocab_size=256)
    norm = model.model.layers[0].input_layernorm.to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576) * 0.5 + 1)
    with torch.inference_mode():
        for x in (torch.randn(1, 1, 576), torch.randn(1, 37, 576) * 4, torch.randn(2, 300, 576),
                  torch.randn(1, 64, 1152)[..., ::2]):   # rows of a strided view
            x = x.to(dtype)
            expected = norm(x)
            assert_matches(rms_norm(x, norm.weight, norm.variance_epsilon), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(dtype):
    torch.manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 5, 700):
            gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)          # [gate | up], as the fused GEMM writes it
            expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
            assert_matches(silu_and_mul(gate_up), expected)
        extreme = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0]]).to(dtype)
        assert_matches(silu_and_mul(extreme), F.silu(extreme[:, :5]) * extreme[:, 5:])
        with pytest.raises(ValueError, match="2 x the intermediate size"):
            silu_and_mul(torch.zeros(3, 7, dtype=dtype))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_switched_modules_equal_hf_modules(arch, dtype):
    """Every norm of a model switches (2 per layer and the final one); an MLP switches once its gate and up share
    one fused product, and gives HF's MLP output from then on."""
    if not packing_available() or (dtype == torch.bfloat16 and not bf16_packing_available()):
        pytest.skip("no oneDNN weight packing for this dtype on this CPU/build: gate/up never fuse")
    torch.manual_seed(2)
    model = tiny_hf_model(arch, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          vocab_size=256).to(dtype)
    adapter = get_adapter(model.config)
    layers = adapter.decoder_layers(model)
    norms = adapter.norms(model, layers)
    mlps = adapter.mlps(layers)
    x = torch.randn(1, 19, 128).to(dtype)
    with torch.inference_mode():
        expected_norms = [n(x) for n in norms]
        expected_mlps = [m(x) for m in mlps]
    assert use_swiglu_mlps(mlps, model.config.hidden_act) == 0      # gate and up are still separate linears
    assert use_native_norms(norms, adapter.rms_norm_class) == len(norms) == 2 * len(layers) + 1
    for mlp in mlps:
        pack_fused([mlp.gate_proj, mlp.up_proj])
    assert use_swiglu_mlps(mlps, "gelu") == 0
    assert use_swiglu_mlps(mlps, model.config.hidden_act) == len(mlps)
    assert all(type(n) is NativeRMSNorm for n in norms) and all(type(m) is SwiGLUMLP for m in mlps)
    with torch.inference_mode():
        for norm, expected in zip(norms, expected_norms):
            assert_matches(norm(x), expected)
        for mlp, expected in zip(mlps, expected_mlps):
            assert_matches(mlp(x), expected)
        # what the kernel does not take runs HF's own forward
        half = x.to(torch.float16)
        norms[0].weight.data = norms[0].weight.data.to(torch.float16)
        assert torch.equal(norms[0](half), norms[0].eager_class.forward(norms[0], half))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    # fp32 fuses gate/up only above oneDNN's size rule: a wide MLP
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("native-elementwise") / "llama", 0,
                                 hidden_size=256, intermediate_size=1536, num_hidden_layers=3)


def _switch_back(hf_model) -> None:
    for module in hf_model.modules():
        if type(module) in (NativeRMSNorm, SwiGLUMLP):
            module.__class__ = module.eager_class


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_runs_every_norm_and_mlp_natively_with_the_same_greedy_tokens(checkpoint, dtype):
    """fp32: HF's greedy tokens; bf16: the tokens of the same engine with its eager modules back (bit-identical
    kernels but for rare ties)."""
    ref, tokenizer = load_hf_model(checkpoint)
    prompts = mixed_prompts(tokenizer, 6, 5, 60, seed=5)
    with ElasticModel.from_pretrained(checkpoint, dtype=dtype, kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=64) as model:
        hf_model = model.worker.hf_model
        num_layers = hf_model.config.num_hidden_layers
        assert sum(type(m) is NativeRMSNorm for m in hf_model.modules()) == 2 * num_layers + 1
        # gate/up are one product on every CPU: oneDNN-packed where it packs the dtype, else stacked views of
        # their back-to-back arena bytes (bf16 on an AVX2-only CPU, ELASTIC_HF_CPU_GEMM=aten)
        fuses = native_elementwise_available(getattr(torch, dtype), torch.device("cpu"))
        assert sum(type(m) is SwiGLUMLP for m in hf_model.modules()) == (num_layers if fuses else 0)
        native = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)]
        _switch_back(hf_model)
        eager = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)]
    assert native == eager
    if dtype == "float32":
        assert native == [hf_greedy(ref, p, MAX_NEW) for p in prompts]
