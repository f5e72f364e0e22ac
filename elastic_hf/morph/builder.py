"""Control-plane wiring of precision morphing: the swap order (an LIS profile, else front to back) and one
MorphManager per worker, over the worker's MorphExecutor (built by the worker itself, morph/executor.py)."""
from __future__ import annotations

from collections.abc import Callable

from elastic_hf.config import CONTROLLER_MODES, MorphConfig
from elastic_hf.morph.controller import ControllerConfig, MorphController
from elastic_hf.morph.executor import MorphInfo
from elastic_hf.morph.manager import MorphManager
from elastic_hf.morph.metrics import MorphMetrics
from elastic_hf.profiling.profile_format import fallback_order, load_profile


def swap_order(config: MorphConfig, hf_config, num_layers: int) -> list[int]:
    if config.profile is None:
        return fallback_order(num_layers)
    return load_profile(config.profile, hf_config).order


def create_manager(config: MorphConfig, send: Callable, worker: int, info: MorphInfo, order: list[int],
                   metrics: MorphMetrics | None) -> MorphManager:
    controller = None
    if config.mode in CONTROLLER_MODES:
        controller = MorphController(ControllerConfig.for_mode(config.mode, **config.controller), order,
                                     info.blocks_per_layer)
    return MorphManager(send, worker, info, config.mode, order, controller, metrics)
