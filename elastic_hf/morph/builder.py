"""Wiring of precision morphing into ElasticModel.from_pretrained, in two stages around weight placement:
`prepare_morph` builds the LayerStore before the arena exists (the quant slot sizes shape the arena), and
`MorphSetup.finish` creates swapper, KV resizer, controller and manager once weights and KV pool are placed."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elastic_hf.morph.controller import MODES, ControllerConfig, MorphController
from elastic_hf.morph.copier import make_copier
from elastic_hf.morph.kv_resizer import KVResizer
from elastic_hf.morph.layer_store import LayerStore
from elastic_hf.morph.layer_swapper import LayerSwapper
from elastic_hf.morph.manager import MorphManager
from elastic_hf.morph.metrics import MorphMetrics
from elastic_hf.morph.variant_builder import VariantConfig
from elastic_hf.profiling.profile_format import fallback_order, load_profile

MORPH_MODES = ("off", "manual") + MODES   # manual: swaps only through morph.to_precision / the admin API


@dataclass(slots=True)
class MorphOptions:
    mode: str = "off"
    profile: str | None = None                 # LIS profile JSON (elastic-hf profile); front-to-back without
    variants: VariantConfig = field(default_factory=VariantConfig)
    controller: dict = field(default_factory=dict)   # ControllerConfig overrides on top of the mode's preset

    def __post_init__(self):
        if self.mode not in MORPH_MODES:
            raise ValueError(f"morph={self.mode!r} is unknown; allowed: {', '.join(MORPH_MODES)}")
        if isinstance(self.variants, dict):
            self.variants = VariantConfig(**self.variants)
        if self.profile is not None and not Path(self.profile).is_file():
            raise ValueError(f"profile={self.profile!r} does not exist; create one with `elastic-hf profile`")
        if self.mode in MODES:
            config = ControllerConfig.for_mode(self.mode, **self.controller)  # validates the overrides now
            if config.precision not in self.variants.precisions:
                raise ValueError(f"morph={self.mode!r} swaps layers to {config.precision} but the layer store "
                                 f"keeps only {list(self.variants.precisions)}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def swap_order(options: MorphOptions, hf_config, num_layers: int) -> list[int]:
    if options.profile is None:
        return fallback_order(num_layers)
    return load_profile(options.profile, hf_config).order


@dataclass(slots=True)
class MorphSetup:
    options: MorphOptions
    store: LayerStore
    order: list[int]

    def headroom_bytes(self, page_size: int) -> int:
        """The largest quant slot, page-rounded: kept uncommitted so a swap can always start."""
        largest = max(max(slots.values()) for slots in self.store.slot_bytes())
        return -(-largest // page_size) * page_size

    def finish(self, engine, layers, arena, placement, kv_pool, budget, device) -> MorphManager:
        self.store.bind(arena, placement)
        resizer = KVResizer(kv_pool, budget, self.headroom_bytes(arena.page_size))
        swapper = LayerSwapper(layers, self.store, arena, placement, make_copier(device), resizer.make_room)
        controller = None
        if self.options.mode in MODES:
            config = ControllerConfig.for_mode(self.options.mode, **self.options.controller)
            block_bytes = kv_pool.layout.block_bytes
            gained = {}
            for precision in self.store.precisions[1:]:
                freed = [placement.layers[i].nbytes - placement.slots[i][precision].nbytes
                         for i in range(len(layers))]
                gained[precision] = sum(freed) // len(freed) // block_bytes
            controller = MorphController(config, self.order, gained)
        metrics = MorphMetrics(engine.metrics.registry, self.store.precisions)
        metrics.set_host_store(self.store.host_bytes())
        return MorphManager(engine, swapper, resizer, controller, self.options.mode, self.order, metrics)


def prepare_morph(options: MorphOptions, hf_model, adapter, layers, tokenizer, checkpoint_dir,
                  model_id: str) -> MorphSetup:
    order = swap_order(options, hf_model.config, len(layers))
    store = LayerStore.build(hf_model, adapter, layers, tokenizer, options.variants, checkpoint_dir, model_id)
    return MorphSetup(options, store, order)
