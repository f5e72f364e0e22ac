"""LIS layer profiling (MorphServe §4.2, Appendix A, Algorithm 1): the order in which to swap decoder layers to
their quantized variant.

    LTS_p = cos(h_p(x), x_p)                   layer transformation sensitivity  (eq. 2)
    LRS_p = cos(h_p(x), h_p^Q(x))              layer replacement sensitivity     (eq. 3)
    MDS_p = cos(f^(Q)(x), f^(Q u {p})(x))      model degradation sensitivity     (eq. 4)
    LIS_p = a1 * LTS_p + a2 * LRS_p + b * MDS_p                                  (eq. 5)

Normalisation (`normalize`): the three cosines live on very different scales. On SmolLM2-135M (W4 AWQ) LTS
spans 0.02-0.97 across layers while MDS spans 0.9980-0.9996, about 100x less, so with the raw sum the order is
"highest LTS first" whatever the weights say. With normalize="minmax" each term is mapped to
[0, 1] by its spread over the layers before weighting, LIS_p = a1 * N(LTS_p) + a2 * N(LRS_p) + b * N(MDS_p),
so a1/a2/b really are the terms' shares (the default); "zscore" divides by the standard deviation instead;
"none" is eq. 5 on the raw cosines. The maps are fixed once: LTS/LRS over all layers, MDS over
the first greedy step (which scores every layer). A fixed affine map per term keeps the lazy greedy's stale
scores comparable with fresh ones (renormalising over the remaining candidates every step would change every
stale score); later MDS values may fall slightly outside [0, 1]. The maps are stored in the profile JSON
("normalization"), with every layer's first-step MDS ("first_mds").

MDS metric (`mds_metric`): "cosine" compares final normed hidden states as described above; "kl" runs the LM
head and uses exp(-KL(p_Q || p_Q+p)) of the next-token distributions, per token, averaged (1 = identical, like a
cosine); "nll" (the default) also runs the LM head and scores the calibration tokens themselves:
exp(NLL_Q - NLL_Q+p), the perplexity ratio (1 = no change, > 1 = quantizing p even lowers the calibration
perplexity). KL penalises any change of the distribution, NLL only the changes that cost likelihood, which is what
Table 8 measures on held-out text.

Measured on SmolLM2-135M (W4 g64 AWQ, calibrated on the first half of wikitext2-valid, perplexity on 32 x 512
tokens of the second half, fp32 30.78), k = 4 / 8 / 16 quantized layers:
    front-to-back                 31.37 / 31.79 / 32.43
    random (mean of 3 orders)     31.21 / 31.91 / 32.86
    none + cosine (raw eq. 5)     31.33 / 31.76 / 32.45
    minmax + cosine               31.23 / 31.58 / 32.40
    minmax + kl                   31.32 / 31.37 / 32.04
    minmax + nll, 2 MDS sequences 31.21 / 31.38 / 31.86
    minmax + nll, 4 MDS sequences 30.84 / 31.07 / 31.78   (the default)
Only the nll variants are no worse than both baselines at every k; 4 sequences make the NLL differences between
layers stand out of the sampling noise (2 and 4 sequences pick different orders).

Cosines are per token over the hidden dimension, averaged over all calibration tokens. f(x) is the final
normed hidden state (the LM head's input) unless mds_metric is "kl" or "nll".

Greedy selection (Algorithm 1): Q starts empty; each step scores every layer not in Q and moves the one with the
highest LIS into Q. Cost control, because a naive implementation runs the whole model per candidate:
- the input of every layer under the current Q is cached, so a candidate p runs only layers p..L-1;
- the winner's trajectory is kept, so committing it costs nothing (only layers after it changed);
- `mds_samples` limits the calibration sequences used for MDS (LTS/LRS and AWQ use all of them);
- `refresh` (lazy greedy): after the first step, which scores every layer, a step re-scores candidates in
  order of their previous LIS and stops once the best fresh score is at least the next stale score, or after
  `refresh` re-scorings. MorphServe's Table 2 shows that a layer's quantization effect is nearly independent of
  which other layers are quantized, so stale scores are good guides. refresh=0 re-scores every candidate
  every step: Algorithm 1 verbatim.
Quantized layers run as fp32 reference copies of their dequantized weights (identical to the int kernels to
~1e-6, see layers/quant_linear.reference_linear), which keeps profiling at fp32 GEMM speed on any CPU.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from elastic_hf.layers.awq import AwqConfig
from elastic_hf.layers.cpu_gemm import use_onednn_linears
from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.quantize_layer import calibrate_and_quantize, decoder_layer_kwargs, reference_layer
from elastic_hf.profiling.profile_format import LisConfig, LisProfile, LisStep, config_hash, lis_score, term_scale


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()  # mean over tokens


@dataclass(slots=True)
class LisResult:
    profile: LisProfile
    variants: dict[int, nn.Module]    # layer index -> quantized decoder layer (int kernels)
    references: dict[int, nn.Module]  # layer index -> fp32 reference copy of the same variant


class _GreedyState:
    """Inputs of every layer under the current quantized set Q, for the MDS sequences."""

    def __init__(self, layers, references, final_norm, kwargs, inputs: list[torch.Tensor], lm_head=None,
                 labels: torch.Tensor | None = None):
        self.layers = layers
        self.references = references
        self.final_norm = final_norm
        self.lm_head = lm_head                    # set: MDS compares next-token distributions (kl) or NLLs (nll)
        self.labels = labels                      # [mds_samples, seq_len - 1] next tokens: mds_metric="nll"
        self.kwargs = kwargs
        self.inputs = inputs                      # L + 1 tensors [mds_samples, seq, hidden]
        self.quantized: set[int] = set()
        self.output = self.model_output(inputs[-1])  # f^(Q)(x)
        self.layer_forwards = 0

    def model_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """f(x): the final normed hidden state [.., hidden]; with lm_head the log-probabilities [.., vocab]; with
        labels the mean negative log-likelihood of the calibration tokens (a 0-d tensor)."""
        normed = self.final_norm(hidden)
        if self.lm_head is None:
            return normed
        if self.labels is not None:
            logits = self.lm_head(normed[:, :-1]).float()                          # [samples, seq - 1, vocab]
            return F.cross_entropy(logits.flatten(0, 1), self.labels.flatten())
        return self.lm_head(normed).float().log_softmax(-1)

    def similarity(self, output: torch.Tensor) -> float:
        if self.lm_head is None:
            return _cosine(self.output, output)
        if self.labels is not None:
            # perplexity ratio ppl_Q / ppl_Q+p: 1 when the candidate changes nothing, > 1 when it even helps
            return math.exp((self.output - output).item())
        # exp(-KL(p_Q || p_Q+p)), KL per token averaged: 1 for identical distributions, like a cosine
        kl = F.kl_div(output, self.output, log_target=True, reduction="none").sum(-1).mean().item()
        return math.exp(-kl)

    def candidate(self, index: int) -> tuple[float, list[torch.Tensor], torch.Tensor]:
        """MDS of quantizing `index` on top of Q, the layer inputs after it (its trajectory) and f^(Q u {index})."""
        hidden = self.references[index](self.inputs[index], **self.kwargs)
        trajectory = [hidden]
        for i in range(index + 1, len(self.layers)):
            layer = self.references[i] if i in self.quantized else self.layers[i]
            hidden = layer(hidden, **self.kwargs)
            trajectory.append(hidden)
        self.layer_forwards += len(self.layers) - index
        output = self.model_output(hidden)
        return self.similarity(output), trajectory, output

    def commit(self, index: int, trajectory: list[torch.Tensor], output: torch.Tensor) -> None:
        """Move `index` into Q with the trajectory and output its candidate() computed (no LM head re-run)."""
        self.quantized.add(index)
        self.inputs[index + 1:] = trajectory
        self.output = output


@torch.no_grad()
def profile_lis(model: nn.Module, adapter, calib_ids: torch.Tensor, scheme: QuantScheme,
                config: LisConfig | None = None, awq_config: AwqConfig | None = None, model_id: str = "",
                calib_file: str = "", progress: bool = True,
                prebuilt: dict[int, nn.Module] | None = None) -> LisResult:
    """calib_ids [samples, seq_len] (see calibration_batch). Builds the quantized variant of every layer
    (RTN or AWQ on the same calibration data), or takes `prebuilt` ones (layer index -> quantized layer, e.g.
    loaded with load_layer_variant), then runs the greedy LIS selection."""
    config = config or LisConfig()
    awq_config = awq_config or AwqConfig(seed=config.seed)
    layers = adapter.decoder_layers(model)
    num_layers = len(layers)
    final_norm = model.get_submodule(adapter.final_norm)
    batch, seq_len = calib_ids.shape
    kwargs_all = decoder_layer_kwargs(model, batch, seq_len)
    kwargs_mds = decoder_layer_kwargs(model, config.mds_samples, seq_len)
    started = time.perf_counter()
    bar = tqdm(total=2 * num_layers, desc="LIS: quantize + LTS/LRS", disable=not progress, unit="layer")

    variants: dict[int, nn.Module] = {}
    references: dict[int, nn.Module] = {}
    lts, lrs = [], []
    hidden = model.get_submodule(adapter.embed_tokens)(calib_ids).float()  # [samples, seq, hidden]
    mds_inputs = [hidden[: config.mds_samples]]
    if prebuilt is not None and sorted(prebuilt) != list(range(num_layers)):
        raise ValueError(f"prebuilt variants cover layers {sorted(prebuilt)}; need all of 0..{num_layers - 1}")
    for i, layer in enumerate(layers):
        if prebuilt is not None:
            variant, reference, output = prebuilt[i], reference_layer(prebuilt[i]), None
        else:
            calibrated = calibrate_and_quantize(layer, adapter, model.config, scheme, hidden, kwargs_all,
                                                awq_config, with_reference=True)
            variant, reference, output = calibrated.quantized, calibrated.reference, calibrated.fp_output
        if output is None:
            output = layer(hidden, **kwargs_all)
        quantized_output = reference(hidden, **kwargs_all)
        lts.append(_cosine(output, hidden))
        lrs.append(_cosine(output, quantized_output))
        variants[i], references[i] = variant, reference
        hidden = output
        mds_inputs.append(hidden[: config.mds_samples])
        bar.update(1)
    calibrated_at = time.perf_counter()

    # The greedy only runs forwards: fp32 linears switch to oneDNN where it is faster (layers/cpu_gemm.py). After
    # the calibration above, so the AWQ scales and LTS/LRS never depend on the GEMM backend.
    use_onednn_linears(model, *references.values())
    lm_head = model.get_submodule(adapter.lm_head) if config.mds_metric in ("kl", "nll") else None
    labels = calib_ids[: config.mds_samples, 1:] if config.mds_metric == "nll" else None
    state = _GreedyState(layers, references, final_norm, kwargs_mds, mds_inputs, lm_head, labels)
    bar.set_description("LIS: greedy selection")
    stale: dict[int, float] = {}
    steps: list[LisStep] = []
    normalization = {"lts": list(term_scale(lts, config.normalize)), "lrs": list(term_scale(lrs, config.normalize))}
    first_mds: list[float] = []
    for step in range(num_layers):
        candidates = [j for j in range(num_layers) if j not in state.quantized]
        # Highest stale LIS first; ties (and the first step) by layer index, so the order is deterministic.
        candidates.sort(key=lambda j: (-stale.get(j, float("inf")), j))
        exhaustive = config.refresh == 0 or step == 0
        best = None  # (lis, layer, mds, trajectory, output)
        if step == 0:
            # Every layer is scored once with Q empty; their MDS spread fixes the MDS map for the whole run.
            # Only the MDS is kept (30 trajectories would not fit in memory); the winner's is recomputed.
            first_mds = [state.candidate(j)[0] for j in range(num_layers)]
            normalization["mds"] = list(term_scale(first_mds, config.normalize))
        for rank, j in enumerate(candidates):
            if not exhaustive and best is not None:
                if rank >= config.refresh or best[0] >= stale[j]:
                    break
            mds, trajectory, output = (first_mds[j], None, None) if step == 0 else state.candidate(j)
            stale[j] = lis_score(config, normalization, lts[j], lrs[j], mds)
            if best is None or stale[j] > best[0]:
                best = (stale[j], j, mds, trajectory, output)
        lis, chosen, mds, trajectory, output = best
        if trajectory is None:
            _, trajectory, output = state.candidate(chosen)
        state.commit(chosen, trajectory, output)
        stale.pop(chosen)
        steps.append(LisStep(step=step, layer=chosen, lts=lts[chosen], lrs=lrs[chosen], mds=mds, lis=lis))
        bar.update(1)
    bar.close()
    finished = time.perf_counter()

    profile = LisProfile(
        model_id=model_id, config_hash=config_hash(model.config), num_layers=num_layers, scheme=scheme,
        config=config, order=[s.layer for s in steps], steps=steps, lts=lts, lrs=lrs, calib_file=calib_file,
        normalization=normalization, first_mds=first_mds,
        timings={"quantize_and_local_s": round(calibrated_at - started, 3),
                 "greedy_s": round(finished - calibrated_at, 3), "total_s": round(finished - started, 3),
                 "greedy_layer_forwards": state.layer_forwards})
    return LisResult(profile=profile, variants=variants, references=references)
