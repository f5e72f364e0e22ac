"""The CUDA-graph ladder of padded batch sizes, where graphs and the Triton kernels are switched on, and the fallback
after a failed capture, checked without a GPU (the graphs themselves: tests/model/test_cuda_graphs.py, on CUDA)."""
from elastic_hf.model.cuda_graphs import capture_sizes


def test_capture_sizes_pad_every_batch_to_a_captured_size():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1) == [1]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    for max_batch in range(1, 70):
        sizes = capture_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
        assert all(any(s >= n for s in sizes) for n in range(1, max_batch + 1))


def test_cpu_models_step_without_graphs(tiny_checkpoint):
    from elastic_hf import ElasticModel
    from elastic_hf.model.runner import ModelRunner

    with ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=4 << 20) as model:
        assert type(model.worker.instance.runner) is ModelRunner   # no graph wrapper on the CPU


def test_a_failed_capture_leaves_the_model_eager_with_the_same_tokens(tiny_checkpoint, caplog):
    """The graph runner's fallback, driven on the CPU by a graphs object whose capture fails: the step runs eagerly,
    graphs stay off afterwards with one warning, and the tokens are the eager ones."""
    from elastic_hf import ElasticModel
    from elastic_hf.model.cuda_graph_runner import CudaGraphRunner
    from elastic_hf.model.cuda_graphs import GraphCaptureError

    class FailingGraphs:
        calls = 0

        def fits(self, num_seqs):
            return True

        def run(self, *args):
            FailingGraphs.calls += 1
            raise GraphCaptureError("batch 4: RuntimeError: operation not permitted when stream is capturing")

    prompts = [[5, 6, 7], [8, 9, 10, 11], list(range(20, 40)), [3]]
    with ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=4 << 20) as model:
        want = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=6, ignore_eos=True)]
        instance = model.worker.instance
        runner = instance.runner = CudaGraphRunner(instance.runner, FailingGraphs())
        with caplog.at_level("WARNING", logger="elastic_hf.model.cuda_graph_runner"):
            got = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=6, ignore_eos=True)]
    assert got == want
    assert FailingGraphs.calls == 1 and runner.decode_graphs is None
    assert [r.message for r in caplog.records].count(
        "CUDA graph capture failed (batch 4: RuntimeError: operation not permitted when stream is capturing): "
        "decode steps run eagerly from now on") == 1


def test_triton_kernels_only_for_cuda_and_power_of_two_tiles():
    import torch

    from elastic_hf.native.triton_paged import triton_paged_available, triton_tile_shapes_ok

    assert not triton_paged_available(torch.device("cpu"), 64, 16)
    assert triton_tile_shapes_ok(64, 16) and triton_tile_shapes_ok(128, 32) and triton_tile_shapes_ok(256, 1)
    # head_dim 96 or 80 (Phi-style), block 24: the torch path, without graphs
    assert not triton_tile_shapes_ok(96, 16) and not triton_tile_shapes_ok(80, 16)
    assert not triton_tile_shapes_ok(64, 24) and not triton_tile_shapes_ok(0, 16)
