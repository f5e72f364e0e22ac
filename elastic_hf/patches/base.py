"""What elastic-hf needs to know about one HF decoder architecture: where the decoder layers are, what the
attention / MLP / norm modules are called, and which of our fast paths and elastic operations its layers allow. The
HF modeling code itself runs unchanged: the paged attention comes in through transformers' AttentionInterface, so
every difference that lives inside HF's forward (scaled embeddings, soft-capping, q/k norms, post-norms, residual
multipliers, MoE routing) needs nothing here. A family's entry only names what differs from Llama."""
from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

_MISSING = object()


@dataclass(frozen=True, slots=True)
class ArchAdapter:
    model_types: tuple[str, ...]
    layers_path: str = "model.layers"
    attention: str = "self_attn"
    q_proj: str = "self_attn.q_proj"
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    gate_proj: str = "mlp.gate_proj"
    up_proj: str = "mlp.up_proj"
    down_proj: str = "mlp.down_proj"
    # Phi-3 keeps q/k/v and gate/up fused in one Linear each: quantized as they are, never split or sharded
    qkv_proj: str | None = None
    gate_up_proj: str | None = None
    # the norm whose output feeds q/k/v and the one feeding the MLP (AWQ folds its scales into them); None where a
    # family normalises after the block instead (OLMo 2)
    input_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")   # every norm of a layer
    final_norm: str = "model.norm"
    embed_tokens: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    mlp: str = "mlp"
    has_qkv_bias: bool = False
    # the MLP is a mixture of experts (3-D expert tensors, not Linears): it stays full precision and whole
    is_moe: bool = False
    # HF's class of the norms, when its forward is LlamaRMSNorm's formula (layers/native_norm.py runs it natively);
    # None where it differs (Gemma's 1 + weight)
    rms_norm_class: str | None = "LlamaRMSNorm"
    # the function of HF's modeling module that applies Llama's rotary formula to q and k (layers/native_rotary.py
    # runs it natively), or None where the architecture's rotary differs
    rotary_function: str | None = "apply_rotary_pos_emb"
    # HF's modeling module when it is not named after the first model type (gemma3_text lives in gemma3)
    module_name: str | None = None
    # an attribute of the HF decoder that scales `inputs_embeds` inside its forward (Granite's
    # embedding_multiplier): a later pipeline stage, whose inputs are hidden states, must not scale them again
    stage_input_scale: str | None = None
    # why tensor-parallel sharding (any deployment of several workers) cannot take this family; None: it can
    sharding_refusal: str | None = None
    # why precision morphing cannot quantize this family's layers; None: it can
    morph_refusal: str | None = None
    # why AWQ cannot fold its scales into this family's layers (RTN quantization still works); None: it can
    awq_refusal: str | None = None

    @property
    def modeling_module(self) -> str:
        """HF's modeling module of the architecture, e.g. transformers.models.llama.modeling_llama."""
        name = self.module_name or self.model_types[0]
        return f"transformers.models.{name}.modeling_{name}"

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def attention_linear_names(self) -> tuple[str, ...]:
        if self.qkv_proj is not None:
            return (self.qkv_proj, self.o_proj)
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    def mlp_linear_names(self) -> tuple[str, ...]:
        if self.is_moe:
            return ()
        if self.gate_up_proj is not None:
            return (self.gate_up_proj, self.down_proj)
        return (self.gate_proj, self.up_proj, self.down_proj)

    def linear_names(self) -> tuple[str, ...]:
        """Every nn.Linear of a decoder layer that precision morphing quantizes, relative to the layer."""
        return self.attention_linear_names() + self.mlp_linear_names()

    def fusion_groups(self, layers: nn.ModuleList) -> list[list[nn.Module]]:
        """Per decoder layer, the linears HF calls back to back on one input: (q, k, v) and (gate, up); nothing
        where the checkpoint already fused them or the layers lack these Linears (a generic model)."""
        if self.morph_refusal:
            return []
        groups = []
        if self.qkv_proj is None:
            groups.append((self.q_proj, self.k_proj, self.v_proj))
        if self.gate_up_proj is None and not self.is_moe:
            groups.append((self.gate_proj, self.up_proj))
        return [[layer.get_submodule(name) for name in names] for layer in layers for names in groups]

    def norms(self, model: nn.Module, layers: nn.ModuleList) -> list[nn.Module]:
        """Every RMSNorm around the blocks the forward runs: each layer's and the final one (a pipeline stage's
        model may lack the final one)."""
        norms = self.layer_norm_modules(layers)
        try:
            norms.append(model.get_submodule(self.final_norm))
        except AttributeError:
            pass
        return norms

    def layer_norm_modules(self, layers) -> list[nn.Module]:
        """Every norm of the given decoder layers, layer by layer."""
        return [layer.get_submodule(name) for layer in layers for name in self.layer_norms]

    def mlps(self, layers: nn.ModuleList) -> list[nn.Module]:
        return [getattr(layer, self.mlp) for layer in layers if hasattr(layer, self.mlp)]

    def head_counts(self, config) -> tuple[int, int, int]:
        """(num_attention_heads, num_key_value_heads, head_dim)."""
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return num_heads, num_kv_heads, head_dim

    def layer_windows(self, config, layers: nn.ModuleList) -> list[int | None]:
        """The sliding window of every decoder layer (None: full attention), as HF passes it to the attention
        function: the attention module's own `sliding_window` where it has one (Gemma, Qwen: per layer type),
        else the config's (Mistral, Phi-3, Mixtral: every layer)."""
        windows = []
        for layer in layers:
            try:
                window = getattr(layer.get_submodule(self.attention), "sliding_window", _MISSING)
            except AttributeError:   # a generic model names its attention otherwise (GPT-2's attn)
                window = _MISSING
            windows.append(getattr(config, "sliding_window", None) if window is _MISSING else window)
        return windows

    def attention_softcap(self, config) -> float | None:
        """Gemma 2's tanh soft-capping of the attention scores (None: none)."""
        return getattr(config, "attn_logit_softcapping", None)

    def for_workers(self, num_workers: int) -> "ArchAdapter":
        """This adapter, for a deployment of `num_workers` workers: several shard their weights (TP and PP), which
        a family with a sharding refusal cannot."""
        if num_workers > 1 and self.sharding_refusal:
            raise ValueError(f"a deployment of {num_workers} workers shards the weights, which this model does not "
                             f"allow: {self.sharding_refusal}. Run one worker (num_workers=1).")
        return self

    def located_in(self, model: nn.Module) -> "ArchAdapter":
        """This adapter with the module paths of `model` where Llama's are not them (a model type without a
        family entry, e.g. GPT-2's transformer.h): the ModuleList of num_hidden_layers decoder layers, and the
        input and output embeddings as HF's own accessors name them."""
        try:
            model.get_submodule(self.layers_path)
            return self
        except AttributeError:
            pass
        config = model.config.get_text_config()
        num_layers = config.num_hidden_layers
        names = {id(m): name for name, m in model.named_modules()}
        lists = (name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers)
        path = next(lists, None)
        if path is None:
            raise ValueError(f"found no list of {num_layers} decoder layers in {type(model).__name__}")
        embed = names.get(id(model.get_input_embeddings()), self.embed_tokens)
        head = model.get_output_embeddings()
        return replace(self, layers_path=path, embed_tokens=embed,
                       lm_head=names.get(id(head), self.lm_head) if head is not None else self.lm_head)

    def prequantized(self, method: str) -> "ArchAdapter":
        """This adapter for a checkpoint whose Linears come quantized (an AWQ file): it serves at that precision."""
        why = f"the {method} checkpoint holds 4-bit weights only, with no full-precision source"
        return replace(self, morph_refusal=self.morph_refusal or f"{why} to morph up to",
                       sharding_refusal=self.sharding_refusal or f"{why} to shard")

    def checked_against(self, layer: nn.Module) -> "ArchAdapter":
        """This adapter with the elastic operations that need a module the layer lacks refused: a model type
        without a family entry runs on Llama's names, and where those are not its names it still serves, full
        precision and unsharded."""
        def missing(names) -> list[str]:
            out = []
            for name in names:
                try:
                    module = layer.get_submodule(name)
                except AttributeError:
                    out.append(name)
                    continue
                if not isinstance(module, nn.Linear):
                    out.append(name)
            return out

        lacking = missing(self.linear_names())
        if not lacking:
            return self
        why = f"its decoder layers have no nn.Linear {', '.join(lacking)} (model type {self.model_types[0]!r})"
        return replace(self, sharding_refusal=self.sharding_refusal or why, awq_refusal=self.awq_refusal or why,
                       morph_refusal=self.morph_refusal or why)
