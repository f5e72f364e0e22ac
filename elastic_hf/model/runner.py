"""Data plane of one worker: turns a scheduled step into one packed varlen forward of the HF model and returns the
logits of the sequences that sample this step. It implements the engine's Runner protocol; a step's inputs are the
engine's SeqStepInput records (engine/step_plan.py: token_ids, num_computed, block_ids, needs_logits), read by
attribute so this lower package does not import the engine."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.kv.paged_batch import build_paged_batch, is_batched_decode


class ModelRunner:
    def __init__(self, model: nn.Module, pool: KVPagePool | None, sliding_window: int | None = None):
        """pool: None until the worker's KV pool exists (a deployment sizes it after start)."""
        self.model = model
        self.pool = pool
        self.sliding_window = sliding_window
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def execute(self, inputs: list) -> torch.Tensor:
        """Returns logits [num_sampling_seqs, vocab] (fp32) in the order of the inputs that need logits."""
        # Decodes go first in the packed batch: their rows are then one contiguous slice, which the attention
        # reads and writes as views instead of gathers and scatters.
        order = sorted(range(len(inputs)), key=lambda i: not is_batched_decode(
            inputs[i].num_computed, len(inputs[i].token_ids), self.sliding_window))
        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        logit_owner: list[int] = []  # index into `inputs` of each logits row
        for i in order:
            seq = inputs[i]
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.num_computed, seq.num_computed + len(seq.token_ids)))
            if seq.needs_logits:
                logit_rows.append(len(input_ids) - 1)
                logit_owner.append(i)
        batch = build_paged_batch(
            self.pool, [(inputs[i].num_computed, len(inputs[i].token_ids), inputs[i].block_ids) for i in order],
            self.sliding_window)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device).unsqueeze(0)  # [1, T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device).unsqueeze(0)   # [1, T]
        # Only the last position of each sampling sequence goes through the LM head (49k vocab rows).
        keep = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep, paged_batch=batch)
        logits = out.logits[0].float()  # [num_sampling_seqs, vocab] in packed order
        if logit_owner != sorted(logit_owner):
            # Back to the callers' order: row r belongs to inputs[logit_owner[r]], so sort rows by owner.
            back = sorted(range(len(logit_owner)), key=logit_owner.__getitem__)
            logits = logits.index_select(0, torch.tensor(back, device=logits.device))
        return logits
