"""The one place a deployment's executor is chosen (parallel/executor.py): the one worker of a single-worker model
in this process, worker processes of this host (mp), or Ray actors across the nodes of a Ray cluster (ray)."""
from __future__ import annotations

from elastic_hf.config import EngineConfig
from elastic_hf.parallel.executor import Executor


def start_executor(config: EngineConfig, checkpoint_dir: str, model_id: str, hf_config) -> Executor:
    if config.distributed_executor_backend == "ray":
        try:
            from elastic_hf.parallel.ray_executor import RayExecutor
        except ImportError as exc:
            raise ImportError(f"distributed_executor_backend='ray' needs Ray ({exc}): pip install "
                              f"'elastic-hf[ray]'") from exc
        return RayExecutor(config, checkpoint_dir, model_id, hf_config)
    if config.num_workers == 1:
        from elastic_hf.parallel.worker import worker_class
        from elastic_hf.parallel.worker_pool import InProcessExecutor

        return InProcessExecutor(worker_class(config)(config, checkpoint_dir, model_id=model_id))
    from elastic_hf.model.loader import parse_dtype
    from elastic_hf.parallel.weight_store import SharedWeightStore
    from elastic_hf.parallel.worker_pool import MultiprocessExecutor
    from elastic_hf.patches import get_adapter

    store = SharedWeightStore.from_checkpoint(checkpoint_dir, get_adapter(hf_config), hf_config.num_hidden_layers,
                                              parse_dtype(config.dtype))
    return MultiprocessExecutor(config, checkpoint_dir, model_id, store)
