"""The native paged decode kernel (elastic_hf/native/paged_decode.c) against dense SDPA on the same K/V, for the
head sizes it specialises (64, 128) and a generic one, several GQA groups, contexts that end inside a block, and
a query given as a strided view (as the HF attention hands it over). Also: how the library is built and cached."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from elastic_hf.native import build
from elastic_hf.native.paged_decode import native_decode_available, paged_decode_attention

pytestmark = pytest.mark.skipif(not build.native_enabled() or build._compiler() is None,
                                reason="no C compiler here (or ELASTIC_HF_NATIVE=0)")


# bf16: the kernel computes in fp32 on the exact bf16 values (products of two bf16 are exact in fp32), so the only
# error is the output's bf16 rounding
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# head_dim 64 / 128 with blocks of 16 or 32 take the AVX-512 path where the CPU has it (query heads in passes of
# up to 4 / 2: groups 3, 4, 7, 8 cover one pass, two full ones and a short last one); 24 and blocks of 8 the
# portable one
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block", [
    (64, 9, 3, 16), (128, 8, 2, 16), (24, 4, 4, 16), (64, 8, 1, 16), (64, 14, 2, 32), (128, 6, 2, 32),
    (64, 9, 3, 8)])
def test_kernel_matches_sdpa(head_dim, num_heads, num_kv_heads, block, dtype):
    # inside a block, exactly one, one past
    check_against_sdpa(torch.tensor([1, 16, 17, 40, 63]), head_dim, num_heads, num_kv_heads, block, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens,num_kv_heads", [([1000], 3), ([1000, 20], 1), ([700, 130, 129], 1), ([4100], 2)])
def test_few_long_contexts_split_and_combine(lens, num_kv_heads, dtype):
    # fewer (sequence, kv head) pairs than 2 per thread: each context is cut into splits of >= 8 blocks, attended
    # apart and combined (at 4 threads: 1000 tokens -> 6 splits; [1000, 20] -> 7, 5 of them empty for the short
    # one; 4,100 -> 2 pairs x 8 splits)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        check_against_sdpa(torch.tensor(lens), 64, 3 * num_kv_heads, num_kv_heads, 16, dtype)
    finally:
        torch.set_num_threads(threads)


def check_against_sdpa(lens: torch.Tensor, head_dim: int, num_heads: int, num_kv_heads: int, block: int,
                       dtype: torch.dtype) -> None:
    """The kernel on scattered pages (NaN past every context) against SDPA on the same K/V, per sequence."""
    assert native_decode_available(dtype, torch.device("cpu"))
    torch.manual_seed(head_dim + num_heads)
    num_seqs, chunks_per_block, layer = len(lens), 3 * num_kv_heads * 2, 2
    max_blocks = -(-int(lens.max()) // block)
    pool_blocks = max(200, 2 * num_seqs * max_blocks)
    kv_chunks = torch.randn(pool_blocks * chunks_per_block, block, head_dim).to(dtype)
    blocks = torch.randperm(pool_blocks)[:num_seqs * max_blocks].view(num_seqs, max_blocks)   # scattered pages
    head_kv = torch.arange(num_kv_heads * 2).view(num_kv_heads, 2)
    table = (blocks[:, None, None, :] * chunks_per_block + head_kv[None, :, :, None]).flatten()
    layer_offset = layer * num_kv_heads * 2
    # page rows past each context hold NaN (a fresh page can hold anything): the kernel must not let them in
    per_seq = (table + layer_offset).view(num_seqs, num_kv_heads * 2, max_blocks)
    for s, n in enumerate(lens.tolist()):
        kv_chunks[per_seq[s, :, n // block]] = torch.where(torch.arange(block)[:, None] < n % block,
                                                           kv_chunks[per_seq[s, :, n // block]], float("nan"))
        kv_chunks[per_seq[s, :, n // block + 1:].flatten()] = float("nan")
    # the query as HF hands it over: [1, heads, T, hd] transposed from [T, heads, hd], decodes at rows 3..7
    packed = torch.randn(1, 3 + num_seqs + 2, num_heads, head_dim).to(dtype).transpose(1, 2)
    q = packed[0, :, 3:3 + num_seqs].transpose(0, 1)                    # [S, heads, hd], non-contiguous
    out = torch.full((num_seqs, num_heads, head_dim), float("nan"), dtype=dtype)

    paged_decode_attention(q, kv_chunks, table, layer_offset, lens, out, num_kv_heads, 0.125)

    # the reference in fp32 on the same (bf16-exact) values
    ctx = kv_chunks[table + layer_offset].float().view(num_seqs, num_kv_heads, 2, max_blocks * block, head_dim)
    for s, n in enumerate(lens.tolist()):
        ref = F.scaled_dot_product_attention(q[s][:, None].float(), ctx[s, :, 0, :n], ctx[s, :, 1, :n],
                                             scale=0.125, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[s].float(), ref, **TOLERANCES[dtype])


def test_library_is_cached_and_a_failing_compiler_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ELASTIC_HF_CACHE", str(tmp_path))
    first = build._build(build.SOURCE_DIR / "paged_decode.c", build._compiler())
    mtime = first.stat().st_mtime_ns
    assert build._build(build.SOURCE_DIR / "paged_decode.c", build._compiler()) == first
    assert first.stat().st_mtime_ns == mtime and list(first.parent.iterdir()) == [first]  # no temp files left

    load_library = build.load_library.__wrapped__  # bypass the per-process cache
    monkeypatch.setenv("CC", shutil.which("false"))
    with caplog.at_level("WARNING"):
        assert load_library("paged_decode") is None
    assert "pure-torch path" in caplog.text
    monkeypatch.setenv("ELASTIC_HF_NATIVE", "0")
    assert load_library("paged_decode") is None


def test_kernels_share_torchs_openmp_runtime():
    """A second OpenMP runtime would keep its own spinning thread pool next to torch's."""
    assert native_decode_available(torch.float32, torch.device("cpu"))
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes
