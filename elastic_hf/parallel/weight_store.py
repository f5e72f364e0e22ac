"""The shared host weight store (ReMP §3.4): the full weights of every sharded Linear, and the vocabulary tables (input
embedding, untied LM head), read from the checkpoint once at start into one shared-memory buffer that all workers
map. A worker that changes TP degree, rolls back a reshape or replaces a dead peer refills its shard chunks from
here instead of reading checkpoint files; a pipeline's first stage reads its embedding rows here and a stage that
takes a table back refills it from here (parallel/stage_tables.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from elastic_hf.layers.shard_layout import SHARDED_KINDS


def linear_module_names(adapter) -> dict[str, str]:
    """kind -> module name relative to a decoder layer."""
    return dict(zip(SHARDED_KINDS, (adapter.q_proj, adapter.k_proj, adapter.v_proj, adapter.o_proj,
                                    adapter.gate_proj, adapter.up_proj, adapter.down_proj)))


# The vocabulary tables the store holds where the checkpoint has them, by key (a key without a layer index).
TABLE_KEYS = ("embed_tokens", "lm_head")


@dataclass(slots=True)
class SharedWeightStore:
    buffer: torch.Tensor                                   # [total_numel] flat, in shared memory
    index: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # key -> (offset, shape)

    @staticmethod
    def key(layer_idx: int, kind: str) -> str:
        return f"{layer_idx}.{kind}"

    def get(self, layer_idx: int, kind: str) -> torch.Tensor:
        """The full weight [out_features, in_features] of one Linear, zero-copy."""
        key = self.key(layer_idx, kind)
        if key not in self.index:
            raise KeyError(f"weight {key!r} is not in the store ({len(self.index)} weights)")
        return self._view(key)

    def table(self, name: str) -> torch.Tensor | None:
        """A vocabulary table [vocab, hidden] (`TABLE_KEYS`), zero-copy; None where the checkpoint has none (a tied
        model's LM head)."""
        return self._view(name) if name in self.index else None

    def _view(self, key: str) -> torch.Tensor:
        offset, shape = self.index[key]
        numel = 1
        for d in shape:
            numel *= d
        return self.buffer[offset:offset + numel].view(shape)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, adapter, num_layers: int, dtype: torch.dtype,
                        shared: bool = True) -> "SharedWeightStore":
        """shared: the buffer in shared memory for forked workers to map; False: a plain buffer (a Ray node's store
        hands it to the node's object store itself: parallel/ray_rendezvous.py)."""
        from safetensors import safe_open

        files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {checkpoint_dir}")
        wanted = {f"{adapter.layers_path}.{i}.{name}.weight": cls.key(i, kind)
                  for i in range(num_layers) for kind, name in linear_module_names(adapter).items()}
        tables = {f"{getattr(adapter, key)}.weight": key for key in TABLE_KEYS}
        shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in wanted or name in tables:
                        shapes[wanted.get(name) or tables[name]] = (str(path), tuple(f.get_slice(name).get_shape()))
        missing = sorted(set(wanted.values()) - set(shapes))
        if missing:
            raise ValueError(f"checkpoint {checkpoint_dir} lacks {len(missing)} Linear weights, e.g. {missing[:3]}")
        wanted.update((name, key) for name, key in tables.items() if key in shapes)
        index, offset = {}, 0
        for key in sorted(shapes, key=_store_order):
            shape = shapes[key][1]
            index[key] = (offset, shape)
            offset += shape[0] * shape[1]
        buffer = torch.empty(offset, dtype=dtype)
        if shared:
            buffer.share_memory_()
        store = cls(buffer, index)
        by_file: dict[str, list[str]] = {}
        for name, key in wanted.items():
            by_file.setdefault(shapes[key][0], []).append(name)
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    key = wanted[name]
                    store._view(key).copy_(f.get_tensor(name))
        return store


def _store_order(key: str) -> tuple:
    """Layer by layer in SHARDED_KINDS order, the vocabulary tables after them."""
    if key in TABLE_KEYS:
        return (1, TABLE_KEYS.index(key))
    layer, kind = _split_key(key)
    return (0, layer, SHARDED_KINDS.index(kind))


def _split_key(key: str) -> tuple[int, str]:
    layer, kind = key.split(".")
    return int(layer), kind
