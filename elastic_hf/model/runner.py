"""Data plane of one worker: turns a scheduled step into one packed varlen forward of the HF model and returns the
logits of the sequences that sample this step. It implements the engine's Runner protocol; a step's inputs are the
engine's SeqStepInput records (engine/step_plan.py: token_ids, num_computed, block_ids, needs_logits,
all_logits), read by attribute so this lower package does not import the engine.

On a pipeline stage (model/stage.py) the runner runs only the stage's layers: a later stage takes the previous
stage's hidden states instead of token ids, and every stage but the last returns hidden states instead of logits."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from elastic_hf.kv.attention_backends import AttentionBackend, LayerAttention
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.model.flat_forward import FlatForward
from elastic_hf.model.stage import StageSpec, StageView


@dataclass(slots=True)
class PackedStep:
    """One step packed for the forward: every input's tokens in packed order (decodes first), the packed rows
    that go through the LM head and the input each belongs to, and the attention metadata of the batch."""
    num_inputs: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    logit_owner: list[int] = field(default_factory=list)   # index into the step's inputs of each logits row
    batch: object = None                                   # the backend's PagedBatch

    @property
    def is_sampling_decode(self) -> bool:
        """Every input is a batched one-token decode that samples once (what a decode CUDA graph replays)."""
        decodes = self.batch.decodes
        return (decodes is not None and decodes.num_seqs == self.num_inputs
                and len(self.logit_rows) == self.num_inputs)


class ModelRunner:
    """The eager runner; model/cuda_graph_runner.py wraps it to replay decode steps as CUDA graphs."""

    def __init__(self, model: nn.Module, pool: KVPagePool | None, attention: AttentionBackend,
                 layer_attention: LayerAttention | None = None, stage_input_scale: str | None = None):
        """pool: None until the worker's KV pool exists (a deployment sizes it after start). attention: the
        instance's backend, chosen once at build (kv/attention_backends.py). layer_attention: the layers' windows
        and soft-cap (None: plain causal everywhere). stage_input_scale: see model/stage.StageView."""
        self.model = model
        self.pool = pool
        self.attention = attention
        self.layer_attention = layer_attention or LayerAttention()
        self.stage_input_scale = stage_input_scale
        # (packed weights leave meta tensors where their plain Parameters were: a tied embedding table among them)
        self.device = next(p.device for p in model.parameters() if not p.is_meta)
        self.stage_view: StageView | None = None
        # HF's model forward as one flat function of ours, where the model's family and layers allow it
        self.flat_forward = FlatForward.for_model(model)
        # The decoder whose forward calls every layer of its `layers` once a step, in order, where their number is
        # the config's (HF's loop runs `layers[:num_hidden_layers]`): the batch carries that order (PagedBatch.
        # layer_order) so that a layer path may compute several layers in one call. None: an unknown decoder
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.decoder = (decoder if isinstance(getattr(decoder, "layers", None), nn.ModuleList)
                        and isinstance(getattr(getattr(decoder, "config", None), "num_hidden_layers", None), int)
                        else None)

    @property
    def stage(self) -> StageSpec | None:
        """None: the whole model (no pipeline)."""
        return self.stage_view.spec if self.stage_view is not None else None

    def set_stage(self, spec: StageSpec, layers: nn.ModuleList) -> None:
        """Run only the layers [spec.layer_start, spec.layer_end) from now on (the whole range undoes it)."""
        if self.stage_view is None:
            self.stage_view = StageView(self.model, layers, self.stage_input_scale)
        self.stage_view.apply(spec)

    @torch.inference_mode()
    def execute(self, inputs: list, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Returns logits [rows, vocab] (fp32) in the inputs' order (one row per input that needs logits, one per
        token for an input with all_logits: see engine/step_plan.py); on a stage
        that is not the last, the hidden states [T, hidden] of every packed token instead. A stage that is not the
        first takes the previous stage's hidden states `hidden_in` [T, hidden] (same packed order) for the ids."""
        return self.forward(self.pack(inputs), hidden_in)

    def pack(self, inputs: list) -> PackedStep:
        """The step as one packed varlen batch, with the attention backend's metadata built once for every layer."""
        # Decodes go first in the packed batch: their rows are then one contiguous slice, which the attention
        # reads and writes as views instead of gathers and scatters.
        order = sorted(range(len(inputs)), key=lambda i: not self.layer_attention.is_batched_decode(
            inputs[i].num_computed, len(inputs[i].token_ids)))
        step = PackedStep(len(inputs))
        for i in order:
            seq = inputs[i]
            step.input_ids.extend(seq.token_ids)
            step.positions.extend(range(seq.num_computed, seq.num_computed + len(seq.token_ids)))
            end = len(step.input_ids)
            if seq.all_logits:   # every position: prompt log-probabilities
                step.logit_rows.extend(range(end - len(seq.token_ids), end))
                step.logit_owner.extend([i] * len(seq.token_ids))
            elif seq.needs_logits:
                step.logit_rows.append(end - 1)
                step.logit_owner.append(i)
        step.batch = self.attention.build_metadata(
            self.pool, [(inputs[i].num_computed, len(inputs[i].token_ids), inputs[i].block_ids) for i in order],
            self.layer_attention)
        decoder = self.decoder
        if decoder is not None and len(decoder.layers) == decoder.config.num_hidden_layers:
            step.batch.layer_order = decoder.layers
        return step

    @torch.inference_mode()
    def forward(self, step: PackedStep, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """The eager forward of a packed step (what `execute` returns)."""
        stage = self.stage
        pos = torch.tensor(step.positions, dtype=torch.long, device=self.device).unsqueeze(0)   # [1, T]
        if stage is None or stage.is_first:
            tokens = {"input_ids": torch.tensor(step.input_ids, dtype=torch.long,
                                                device=self.device).unsqueeze(0)}            # [1, T]
        else:
            if hidden_in is None or hidden_in.shape[0] != len(step.input_ids):
                raise ValueError(f"stage of layers {stage.layers} needs the previous stage's hidden states for "
                                 f"{len(step.input_ids)} tokens, got "
                                 f"{None if hidden_in is None else tuple(hidden_in.shape)}")
            tokens = {"inputs_embeds": hidden_in.unsqueeze(0)}                                 # [1, T, hidden]
        flat = self.flat_forward if self.flat_forward is not None and self.flat_forward.runs_now() else None
        if stage is not None and not stage.is_last:
            if flat is not None:
                return flat(pos, step.batch, tokens.get("input_ids"), tokens.get("inputs_embeds"))[0]
            out = self.stage_view.decoder(**tokens, position_ids=pos, use_cache=False, paged_batch=step.batch)
            return out.last_hidden_state[0]                                                    # [T, hidden]
        # Only the last position of each sampling sequence goes through the LM head (49k vocab rows).
        # sorted() is stable: the rows of one input stay in position order when they go back to the callers' order.
        keep = torch.tensor(step.logit_rows, dtype=torch.long, device=self.device)
        if flat is not None:
            logits = flat(pos, step.batch, tokens.get("input_ids"), tokens.get("inputs_embeds"), keep)
        else:
            logits = self.model(**tokens, position_ids=pos, use_cache=False, logits_to_keep=keep,
                                paged_batch=step.batch).logits
        return callers_order(logits[0].float(), step.logit_owner)   # [num_sampling_seqs, vocab]


def callers_order(logits: torch.Tensor, logit_owner: list[int]) -> torch.Tensor:
    """Rows in packed order -> rows in the callers' order: row r belongs to inputs[logit_owner[r]]."""
    if logit_owner != sorted(logit_owner):
        back = sorted(range(len(logit_owner)), key=logit_owner.__getitem__)
        logits = logits.index_select(0, torch.tensor(back, device=logits.device))
    return logits
