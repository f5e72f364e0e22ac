"""LayerStore: every variant of every decoder layer, resident in host memory (pinned when the model is on a GPU),
plus the module object that runs each variant (MorphServe §4.3 "model preloading").

- fp: the HF decoder layer itself, whose parameters are views of the layer's fp region; its image is a host
  copy of that region's bytes, so restoring it is bit-identical.
- w8 / w4: a quantized copy of the layer (layers/quantize_layer) whose tensors are re-bound as views of the
  layer's quant slot for that precision; its image holds those tensors in the kernel layout of the device.
A swap copies an image into its arena range and switches `layers[i]` to the matching module."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from elastic_hf.config import MorphConfig
from elastic_hf.memory.arena import PageArena
from elastic_hf.morph.layer_image import LayerImage, bind_to_arena, build_image, image_of_range
from elastic_hf.morph.variant_builder import PRECISIONS, build_variants
from elastic_hf.units import round_up


def _share_config(variant: nn.Module, original: nn.Module) -> None:
    """deepcopy gave the variant its own copies of the HF config; point it back at the model's one, so settings
    such as the attention implementation stay a single source of truth."""
    originals = dict(original.named_modules())
    for name, module in variant.named_modules():
        source = originals.get(name)
        if source is not None and hasattr(module, "config") and hasattr(source, "config"):
            module.config = source.config


class LayerStore:
    def __init__(self, layers: nn.ModuleList, variants: dict[str, list[nn.Module]], pin: bool):
        num_layers = len(layers)
        for precision, modules in variants.items():
            if len(modules) != num_layers:
                raise ValueError(f"{precision} has {len(modules)} layer variants for {num_layers} layers")
        self.num_layers = num_layers
        self.pin = pin
        self.precisions = ("fp",) + tuple(p for p in PRECISIONS if p in variants)
        self._by_precision: dict[str, list[nn.Module]] = {"fp": list(layers)}
        self._images: dict[str, list[LayerImage | None]] = {"fp": [None] * num_layers}
        for precision, modules in variants.items():
            for module, original in zip(modules, layers):
                _share_config(module, original)
            self._by_precision[precision] = list(modules)
            self._images[precision] = [build_image(m, pin) for m in modules]
        self._bound = False

    @classmethod
    def build(cls, model: nn.Module, adapter, layers: nn.ModuleList, config: MorphConfig,
              checkpoint_dir: Path | None, model_id: str = "") -> "LayerStore":
        pin = next(layers[0].parameters()).device.type == "cuda"
        return cls(layers, build_variants(model, adapter, layers, config, checkpoint_dir, model_id), pin)

    def headroom_bytes(self, page_size: int) -> int:
        """The largest quant slot, page-rounded: kept uncommitted so a swap to a quantized variant can always
        start, even when every KV block is in use (exactly when morphing is needed)."""
        largest = max(max(slots.values()) for slots in self.slot_bytes())
        return round_up(largest, page_size)

    # ---- sizes (before placement) ----
    def slot_bytes(self) -> list[dict[str, int]]:
        """Per layer: quantized precision -> image bytes, the payload of its quant slot."""
        return [{p: self._images[p][i].nbytes for p in self.precisions if p != "fp"} for i in range(self.num_layers)]

    # ---- after placement ----
    def bind(self, arena: PageArena, weights) -> None:
        """Capture the fp images from the placed fp regions and re-bind the quantized modules to their slots
        (the quantized modules' own host tensors are dropped here: the images hold their bytes). weights: the
        worker's PlacedWeights or ShardedWeights (fp_region(layer), slot(layer, precision))."""
        for i in range(self.num_layers):
            region = weights.fp_region(i)
            data = image_of_range(arena, region.offset, region.payload_bytes, self.pin)
            self._images["fp"][i] = LayerImage([], data)
            for precision in self.precisions[1:]:
                slot = weights.slot(i, precision)
                image = self._images[precision][i]
                if slot.payload_bytes != image.nbytes:
                    raise ValueError(f"layer {i} {precision} slot holds {slot.payload_bytes} bytes, image has "
                                     f"{image.nbytes}")
                bind_to_arena(self._by_precision[precision][i], image.specs, arena, slot.offset)
        self._bound = True

    def module(self, layer: int, precision: str) -> nn.Module:
        return self._by_precision[precision][layer]

    def modules_of(self, precision: str) -> list[nn.Module]:
        """Every layer's module at `precision`, in layer order."""
        return list(self._by_precision[precision])

    def image(self, layer: int, precision: str) -> LayerImage:
        image = self._images[precision][layer]
        if image is None:
            raise RuntimeError("LayerStore.bind() has not run: the fp images are captured after placement")
        return image

    def has(self, precision: str) -> bool:
        return precision in self.precisions

    def host_bytes(self) -> dict[str, int]:
        """Host bytes held per precision (images only; the fp modules are views of the device arena)."""
        return {p: sum(img.nbytes for img in self._images[p] if img is not None) for p in self.precisions}

    def report(self) -> dict:
        host = self.host_bytes()
        return {"pinned": self.pin, "host_bytes": host, "host_bytes_total": sum(host.values()),
                "layer_bytes": {p: (self._images[p][0].nbytes if self._images[p][0] is not None else None)
                                for p in self.precisions}}
