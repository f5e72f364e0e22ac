"""native/decode_gemm.c reading packed weights, in the layout `packed_layout` writes (what packing in place does) and,
where oneDNN's own packing is that layout (AVX-512), straight from oneDNN's packed tensor: its products equal F.linear's
and oneDNN's (bf16 up to a last-bit rounding in a few outputs, fp32 up to float rounding) for decode and prefill row
counts, with and without bias and for inputs with a row stride; it refuses the shapes it cannot read, and packed
linears use it only where it reads the packing. On an AVX2-only CPU the AVX2 + FMA build of the kernel runs."""
import pytest
import torch
from torch import nn

from elastic_hf.layers.packed_linear import PACK_BATCH_HINT, PackedLinear, pack_linear, packing_available
from elastic_hf.native import decode_gemm as dg

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch build without oneDNN weight packing")


def _dtypes():
    return [pytest.param(dtype, marks=pytest.mark.skipif(not dg.decode_gemm_available(dtype),
                                                          reason=f"no native decode GEMM for {dtype} on this CPU"))
            for dtype in (torch.float32, torch.bfloat16)]


def _packings(weight):
    """(name, address, keep-alive) of every packing of `weight` the kernel reads on this CPU: ours always, oneDNN's
    where its layout is ours (AVX-512; on AVX2 for some fp32 shapes)."""
    n, k = weight.shape
    ours = dg.packed_layout(weight).contiguous()
    out = [("ours", ours.data_ptr(), ours)]
    if dg.reads_packed(n, k, weight.dtype, PACK_BATCH_HINT):
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        out.append(("onednn", dg.packed_data_ptr(onednn), onednn))
    return out


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (128, 64)])
def test_products_equal_onednn_and_f_linear(dtype, n, k):
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k) * 0.05).to(dtype)
    bias = torch.randn(n).to(dtype)
    assert dg.reads_layout(n, k, dtype)
    for name, address, packed in _packings(weight):
        # 1-13: decode batches (every row-tile size), 300: more rows than one pass of the kernel (ROW_CHUNK = 128)
        for rows in (1, 2, 5, 8, 13, 300):
            x = torch.randn(1, rows, k).to(dtype)
            for b in (None, bias):
                got = dg.decode_gemm(x, address, b, n)                            # [1, rows, n]
                ref = nn.functional.linear(x, weight, b)
                assert got.shape == ref.shape == (1, rows, n) and got.dtype == dtype, name
                exact = nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
                if dtype == torch.bfloat16:
                    # fp32 accumulation in k order, rounded once: a last-bit difference from oneDNN (or ATen's bf16
                    # GEMM where oneDNN packs no bf16) in a few outputs
                    other = ref if name == "ours" else torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
                    assert (got != other).float().mean() < 0.01, name
                    # the output's rounding (half a bf16 ulp: 2^-9 of it, 2^-8 allowed) plus fp32 accumulation over k
                    # terms (at most k x 2^-24 of the terms' magnitudes: an output near zero by cancellation has
                    # only that, which a bound relative to the output alone would not allow)
                    terms = nn.functional.linear(x.double().abs(), weight.double().abs(),
                                                 None if b is None else b.double().abs())
                    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + k * 2 ** -24 * terms).all(), name
                else:
                    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), name
                    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), name


@pytest.mark.parametrize("dtype", _dtypes())
def test_rows_with_a_stride_and_no_rows(dtype):
    torch.manual_seed(3)
    weight = torch.randn(192, 64).to(dtype)
    wide = torch.randn(4, 3 * 64).to(dtype)
    x = wide[:, 64:128]                                       # rows 192 elements apart
    assert x.stride() == (192, 1)
    ref = nn.functional.linear(x, weight)
    for name, address, _ in _packings(weight):
        got = dg.decode_gemm(x, address, None, 192)
        assert (got.float() - ref.float()).abs().max() <= 2e-2 * ref.abs().max(), name
        empty = dg.decode_gemm(torch.empty(0, 64, dtype=dtype), address, None, 192)
        assert empty.shape == (0, 192)


def test_shapes_it_cannot_read_stay_on_onednn(monkeypatch):
    # padded by oneDNN (outputs not a multiple of 64, inputs not of 32): the kernel never reads padding
    assert not dg.reads_packed(100, 64, torch.float32, PACK_BATCH_HINT)
    assert not dg.reads_packed(128, 40, torch.bfloat16, PACK_BATCH_HINT)
    assert not dg.reads_packed(128, 64, torch.float16, PACK_BATCH_HINT)
    assert not dg.reads_layout(100, 64, torch.float32) and not dg.reads_layout(128, 40, torch.bfloat16)
    linear = nn.Linear(70, 100)
    pack_linear(linear)
    assert type(linear) is PackedLinear and linear.direct is None
    x = torch.randn(3, 70)
    assert torch.allclose(linear(x), torch.ops.mkldnn._linear_pointwise(x, linear.packed_weight, linear.bias, "none",
                                                                        [], ""))
    monkeypatch.setenv(dg.ENV_VAR, "0")                       # the A/B switch: oneDNN for every packed linear
    assert not dg.decode_gemm_available(torch.float32)
    switched_off = nn.Linear(576, 576)
    pack_linear(switched_off)
    assert switched_off.direct is None


@pytest.mark.parametrize("dtype", _dtypes())
def test_packed_linear_runs_the_kernel(dtype, monkeypatch):
    if not dg.reads_packed(1536, 576, dtype, PACK_BATCH_HINT):
        pytest.skip(f"oneDNN's packing of {dtype} is not the kernel's layout on this CPU (packed in place instead)")
    torch.manual_seed(4)
    linear = nn.Linear(576, 1536).to(dtype)
    x = torch.randn(1, 7, 576).to(dtype)
    expected = linear(x)
    pack_linear(linear)
    assert linear.direct is not None and linear.direct.out_features == 1536
    calls = []
    original = dg.decode_gemm
    monkeypatch.setattr("elastic_hf.layers.packed_linear.decode_gemm",
                        lambda *args: calls.append(1) or original(*args))
    got = linear(x)
    assert calls == [1]
    assert (got.float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max()
    # another dtype than the weight's goes to oneDNN (which refuses or converts as it always has), not the kernel
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError):
        linear(x.to(other))
    assert calls == [1]


@pytest.mark.parametrize("dtype", _dtypes())
def test_a_copy_of_the_source_builds_to_the_same_bits(dtype, tmp_path):
    """build_source (what benchmarks/kernel_ab.py loads a git revision's kernel with) compiles a copy kept elsewhere
    with the package's flags: the same source gives the package's own products, bit for bit."""
    import ctypes
    import shutil

    from elastic_hf.native.build import SOURCE_DIR, build_source

    for path in [SOURCE_DIR / "decode_gemm.c", *SOURCE_DIR.glob("*.h")]:
        shutil.copy(path, tmp_path / path.name)
    lib = build_source(tmp_path / "decode_gemm.c")
    fn = getattr(lib, "elastic_decode_gemm_f32" if dtype == torch.float32 else "elastic_decode_gemm_bf16")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int], ctypes.c_int
    torch.manual_seed(3)
    n, k, rows = 960, 576, 8
    packed = dg.packed_layout((torch.randn(n, k) * 0.05).to(dtype)).contiguous()
    x = torch.randn(rows, k).to(dtype)
    got = torch.empty(rows, n, dtype=dtype)
    assert fn(x.data_ptr(), k, packed.data_ptr(), None, got.data_ptr(), n, rows, n, k, 2) == 0
    assert torch.equal(got, dg.decode_gemm(x, packed.data_ptr(), None, n))


def _entry_point(name):
    """native/decode_gemm.c's entry point `name` (any dtype's), bound as the module binds its own."""
    import ctypes

    from elastic_hf.native.build import bind, load_library
    if load_library("decode_gemm") is None:
        pytest.skip("no native kernels on this machine")
    return bind("decode_gemm", name, dg._SIGNATURE, ctypes.c_int)


def test_bf16_on_vdpbf16ps_gives_the_widened_kernels_bits():
    """tile_bf16_dot (vdpbf16ps) and tile_bf16 (widened fp32 FMAs) sum in the same order with the same roundings, so
    whichever the probe takes, a bf16 model's tokens are the same: bit-equal products at every row-tile size the dot
    entry runs (1-2 rows it hands to the widened walk itself), over a K chunk boundary and past ROW_CHUNK rows, with
    a bias and a row stride (denormal-free values: vdpbf16ps flushes those)."""
    dot = _entry_point(dg._BF16_DOT_ENTRY_POINT)
    widened = _entry_point(dg._ENTRY_POINTS[torch.bfloat16])
    torch.manual_seed(5)
    n, k = 192, 2048                       # 64 K tiles: 16 of the dot tile's 4-tile chunks
    packed = dg.packed_layout((torch.randn(n, k) * 0.05).to(torch.bfloat16)).contiguous()
    bias = torch.randn(n).to(torch.bfloat16)
    wide = torch.randn(300, k + 64).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 300):
        x = wide[:rows, 32:32 + k]                                   # [rows, k], rows k + 64 elements apart
        for b in (None, bias):
            outs = []
            for fn in (dot, widened):
                y = torch.empty(rows, n, dtype=torch.bfloat16)
                status = fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(),
                            y.data_ptr(), n, rows, n, k, 2)
                if fn is dot and status == -1:
                    pytest.skip("built without AVX512-BF16: no vdpbf16ps kernel")
                assert status == 0
                outs.append(y)
            assert torch.equal(outs[0], outs[1]), (rows, b is None)


def test_the_bf16_dot_setting(monkeypatch):
    monkeypatch.setenv(dg.BF16_DOT_ENV_VAR, "0")
    assert dg.bf16_dot_chosen.__wrapped__() is False
    monkeypatch.setenv(dg.BF16_DOT_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="ELASTIC_HF_BF16_DOT='fast' is not one of auto, 0, 1"):
        dg.bf16_dot_chosen.__wrapped__()
    monkeypatch.setenv(dg.BF16_DOT_ENV_VAR, "1")      # forced: taken wherever the build has AVX512-BF16
    x, w, y = (torch.zeros(size, dtype=torch.bfloat16) for size in (32, 64 * 32, 64))
    has_dot = _entry_point(dg._BF16_DOT_ENTRY_POINT)(x.data_ptr(), 32, w.data_ptr(), None, y.data_ptr(), 64, 1, 64,
                                                    32, 1) == 0
    assert dg.bf16_dot_chosen.__wrapped__() is has_dot
    from pathlib import Path
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():        # built with -march=native: the kernel exactly where the CPU has it
        assert has_dot == ("avx512_bf16" in cpuinfo.read_text())


@pytest.mark.parametrize("dtype", _dtypes())
def test_many_rows_give_the_bits_of_few(dtype):
    """From PANEL_FROM_ROWS rows a bf16 product on AVX2 runs in panels (packed rows and strips, sums kept between
    K panels), which must sum each output in the walk's order: the product of all rows at once equals, bit for bit,
    the same rows multiplied 48 at a time (the walk). Over several K panels (k = 2048: 8 of 256), two row blocks with
    a short last tile (400 rows: 384 + 16), more strips a thread than one group of sums (n = 2304: 72 strips each on
    2 threads), a bias and a row stride. Elsewhere (fp32, AVX-512) both sides are the walk."""
    entry = _entry_point(dg._ENTRY_POINTS[dtype])
    torch.manual_seed(9)
    n, k, rows = 2304, 2048, 400
    packed = dg.packed_layout((torch.randn(n, k) * 0.05).to(dtype)).contiguous()
    bias = torch.randn(n).to(dtype)
    x = torch.randn(rows, k + 64).to(dtype)[:, 32:32 + k]           # rows k + 64 elements apart
    for b in (None, bias):
        whole = torch.empty(rows, n, dtype=dtype)
        assert entry(x.data_ptr(), x.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(),
                     whole.data_ptr(), n, rows, n, k, 2) == 0
        parts = torch.empty(rows, n, dtype=dtype)
        for r0 in range(0, rows, 48):
            part = x[r0:r0 + 48]
            assert entry(part.data_ptr(), x.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(),
                         parts[r0:].data_ptr(), n, part.shape[0], n, k, 2) == 0
        assert torch.equal(whole, parts), b is None
