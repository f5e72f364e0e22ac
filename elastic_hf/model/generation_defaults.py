"""Default sampling values from a model's generation_config.json, as vLLM's `--generation-config` reads them: the
fields the model's authors set (those differing from transformers' GenerationConfig defaults) among temperature,
top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) become the defaults of requests that set
none.

`mode`: "auto" reads the checkpoint's file, "vllm" none (the engine's own defaults), a directory its file."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens", "min_p": "min_p"}
# the SamplingParams fields a greedy reading (no do_sample) leaves out: HF generate's warpers. The repetition
# penalty is a logits processor HF applies in greedy decoding too, so it stays.
SAMPLE_ONLY = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    sampling: dict = field(default_factory=dict)   # SamplingParams field -> value, only what the file sets
    do_sample: bool = False                        # HF generate samples only with do_sample (offline calls follow)

    def offline(self) -> dict:
        """Defaults of ElasticModel.generate/chat without sampling arguments (and the reading of a GenerationConfig
        passed to generate): HF generate's, greedy unless do_sample, then every value."""
        if not self.do_sample:
            return {**{k: v for k, v in self.sampling.items() if k not in SAMPLE_ONLY}, "temperature": 0.0}
        return dict(self.sampling)


def generation_defaults(mode: str, checkpoint_dir: str | Path) -> GenerationDefaults:
    if mode == "vllm":
        return GenerationDefaults()
    from transformers import GenerationConfig

    source = Path(checkpoint_dir if mode == "auto" else mode)
    try:
        config = GenerationConfig.from_pretrained(source)
    except OSError:   # no generation_config.json: nothing to default
        if mode != "auto":
            raise ValueError(f"generation_config={mode!r}: no readable generation_config.json there") from None
        return GenerationDefaults()
    diff = config.to_diff_dict()
    sampling = {ours: diff[theirs] for theirs, ours in SAMPLING_FIELDS.items() if diff.get(theirs) is not None}
    if sampling:
        log.info("default sampling from %s/generation_config.json: %s (--generation-config vllm ignores it)",
                 source, sampling)
    return GenerationDefaults(sampling, bool(diff.get("do_sample", False)))
