"""The CUDA-graph ladder of padded batch sizes and where graphs are switched on, checked without a GPU (the graphs
themselves: tests/model/test_cuda_graphs.py, on CUDA)."""
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

    with ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=4 << 20) as model:
        assert model.worker.instance.runner.decode_graphs is None
