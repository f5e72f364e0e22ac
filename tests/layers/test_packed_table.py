"""An LM head packed in its own bytes (layers/packed_table.py): tied or untied, the model's logits stay F.linear's
(bf16 bit for bit up to the kernel's last-bit rounding, fp32 within round-off) and a tied embedding reads exactly
the rows of the plain table out of the packed bytes; the plain weights are gone (meta), no byte moved."""
import pytest
import torch
from torch import nn

from elastic_hf.layers.packed_linear import PackedLinear
from elastic_hf.layers.packed_table import PackedEmbedding, pack_head_in_place
from elastic_hf.native.decode_gemm import decode_gemm_available
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.skipif(not decode_gemm_available(torch.bfloat16),
                                reason="no native decode GEMM for bf16 on this CPU (AVX-512 BF16)")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_head_gives_the_plain_heads_logits_and_embeddings(tied, dtype):
    model = tiny_hf_model("llama", tie_word_embeddings=tied).to(dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, 23))
    with torch.inference_mode():
        expected_embeddings = model.get_input_embeddings()(ids)
        expected = model(input_ids=ids).logits
    address = model.get_output_embeddings().weight.data_ptr()
    assert pack_head_in_place(model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(head) is PackedLinear and head.direct.in_arena and head.packed_weight.data_ptr() == address
    assert head.weight.is_meta and (type(embedding) is PackedEmbedding) == tied and embedding.weight.is_meta == tied
    with torch.inference_mode():
        assert torch.equal(embedding(ids), expected_embeddings)
        got = model(input_ids=ids).logits
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, **tol)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_scaled_embedding_or_a_biased_head_stays_plain():
    class ScaledEmbedding(nn.Embedding):   # Gemma's kind: the lookup is not the table's row
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = tiny_hf_model("llama", tie_word_embeddings=True)
    model.get_input_embeddings().__class__ = ScaledEmbedding
    assert not pack_head_in_place(model) and not model.get_output_embeddings().weight.is_meta
    model = tiny_hf_model("llama", tie_word_embeddings=False)
    head = model.get_output_embeddings()
    head.bias = nn.Parameter(torch.zeros(head.out_features, dtype=torch.float64), requires_grad=False)
    assert not pack_head_in_place(model) and type(head) is nn.Linear
