"""Structured output on the default model: what the grammar's per-step token mask costs, and how often a constrained
output is valid.

    python benchmarks/structured_output.py [--batches 1 16 64] [--tokens 48] [--runs 3] [--schemas 200]

1. Per-step cost at each batch size: the same prompts decode `--tokens` tokens free and under a JSON schema whose
   output is longer than that (both runs make exactly the same number of steps), alternating `--runs` times. Per
   step: the wall time of both, and the time the constrained run spent in the grammar (filling the bitmasks,
   engine/grammar.py, and applying them to the logits, native/token_bitmask.c), medians with spread.
   RESULT structured_mask_ms_b<B> (fill + apply per step) and RESULT structured_step_overhead_b<B> (constrained step
   / free step).
2. Validity: `--schemas` randomized JSON schemas (nested objects, arrays, enums, bounded and unbounded strings and
   numbers, optional fields; seeded), one greedy chat request each giving the schema and asking for an object of
   it, all in flight together. Valid: it finished by itself and `jsonschema` accepts it.
   RESULT structured_valid_rate.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CallTimer, machine_description, wikitext_prompts  # noqa: E402



def long_output(item: dict) -> dict:
    """A schema whose outputs outlast every timed run: an array of at least 200 `item`s."""
    return {"type": "object", "properties": {"notes": {"type": "array", "minItems": 200, "items": item}},
            "required": ["notes"], "additionalProperties": False}


# strings as pydantic writes `str` (llguidance's slices make a free string's mask cheap), and bounded strings,
# whose every mask checks each token's length (llguidance's costly case)
MASK_SCHEMAS = {"": long_output({"type": "string"}), "bounded_": long_output({"type": "string", "maxLength": 12})}


def decode_seconds(model, prompts, tokens: int, constraint) -> tuple[float, int]:
    """Wall seconds of the decode steps (after every prompt's first token) and their number."""
    from elastic_hf import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=constraint)
    dep = model.deployment
    ids = [dep.add_request(None, p, params) for p in prompts]
    while any(dep.instances[0].engine.scheduler.waiting) or any(
            s.num_output_tokens == 0 for s in dep.instances[0].engine.scheduler.running):
        dep.step()
    start, steps, finished = time.perf_counter(), 0, set()
    while len(finished) < len(ids):
        for out in dep.step():
            if out.finished:
                finished.add(out.request_id)
        steps += 1
    return time.perf_counter() - start, steps


def mask_cost(model, batches, tokens: int, runs: int) -> None:
    for label, schema in MASK_SCHEMAS.items():
        print(f"strings: {'bounded (maxLength 12)' if label else 'free'}")
        mask_cost_of(model, batches, tokens, runs, schema, label)


def mask_cost_of(model, batches, tokens: int, runs: int, schema: dict, label: str) -> None:
    from elastic_hf.engine.structured_outputs import StructuredOutputsParams

    import elastic_hf.engine.llm_engine as llm_engine
    import elastic_hf.engine.sampler as sampler

    constraint = StructuredOutputsParams(json=schema)
    # the grammar's share of a step: filling the bitmasks and applying them, where the engine calls them
    timer = CallTimer((llm_engine, "fill_bitmasks"), (sampler, "apply_token_bitmask"))
    rows = []
    for batch in batches:
        prompts = wikitext_prompts(model.tokenizer, batch, 24, 24, seed=batch)
        free, constrained, grammar = [], [], []
        for _ in tqdm(range(runs), desc=f"batch {batch}", leave=False):
            seconds, steps = decode_seconds(model, prompts, tokens, None)
            free.append(seconds / steps * 1e3)
            timer.take()
            seconds, steps = decode_seconds(model, prompts, tokens, constraint)
            constrained.append(seconds / steps * 1e3)
            grammar.append(timer.take() / steps * 1e3)
        rows.append((batch, free, constrained, grammar))
    spread = lambda xs: f"[{min(xs):.2f}-{max(xs):.2f}]"   # noqa: E731
    print(f"{'batch':>5} {'free ms/step':>22} {'constrained ms/step':>22} {'grammar ms/step':>22} {'ratio':>7}")
    for batch, free, constrained, grammar in rows:
        f, c, g = (statistics.median(x) for x in (free, constrained, grammar))
        print(f"{batch:>5} {f:>8.2f} {spread(free):>13} {c:>8.2f} {spread(constrained):>13} {g:>8.3f} "
              f"{spread(grammar):>13} {c / f:>6.3f}x")
    for batch, free, constrained, grammar in rows:
        f, c, g = (statistics.median(x) for x in (free, constrained, grammar))
        print(f"RESULT structured_mask_ms_{label}b{batch} {g:.3f}")
        print(f"RESULT structured_step_overhead_{label}b{batch} {c / f:.3f}")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema: 1-5 properties of mixed types, some optional, nesting up to depth 2."""
    def value(d):
        kind = rng.choice(["string", "string", "integer", "number", "boolean", "enum", "array", "object"]
                          if d < 2 else ["string", "integer", "number", "boolean", "enum"])
        if kind == "string":
            return {"type": "string", **({"maxLength": rng.randint(5, 40)} if rng.random() < 0.5 else {})}
        if kind == "integer":
            return {"type": "integer", **({"minimum": 0, "maximum": rng.choice([10, 100, 10000])}
                                          if rng.random() < 0.5 else {})}
        if kind == "number":
            return {"type": "number"}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no", "unknown"],
                                       rng.randint(2, 4))}
        if kind == "array":
            return {"type": "array", "items": value(d + 1), "maxItems": rng.randint(1, 4)}
        return random_schema(rng, d + 1)

    words = ["name", "title", "age", "count", "price", "color", "size", "active", "tags", "owner", "city", "score",
             "level", "notes", "id", "kind"]
    names = rng.sample(words, rng.randint(1, 5))
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": {n: value(depth) for n in names}, "required": required,
            "additionalProperties": False}


def valid_rate(model, num_schemas: int, seed: int = 0) -> None:
    import jsonschema

    from elastic_hf import SamplingParams, StructuredOutputsParams

    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(num_schemas)]
    # the schema in the prompt, as clients give it to the model (OpenAI does the same with a strict schema)
    conversations = [[{"role": "user", "content": "Reply with a JSON object that matches this JSON schema: "
                       + json.dumps(s)}] for s in schemas]
    verdicts = {"valid": 0, "length": 0, "schema": 0}
    start = time.perf_counter()
    dep = model.deployment
    requests = {}   # request id -> schema; all in flight at once (the engine batches them)
    for schema, conversation in zip(schemas, conversations):
        prompt = dep.input_processor.render_chat(conversation)
        constraint = StructuredOutputsParams(json=schema)
        params = SamplingParams(temperature=0.0, max_tokens=400, structured_outputs=constraint)
        requests[dep.add_request(None, prompt, params)] = schema
    with tqdm(total=num_schemas, desc="schemas") as bar:
        while dep.has_unfinished_requests():
            for out in dep.step():
                if not out.finished:
                    continue
                bar.update()
                schema, o = requests[out.request_id], out.outputs[0]
                if o.finish_reason != "stop":
                    verdicts["length"] += 1
                    continue
                try:
                    jsonschema.validate(json.loads(o.text), schema)
                    verdicts["valid"] += 1
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    verdicts["schema"] += 1
    print(f"{num_schemas} schemas in {time.perf_counter() - start:.0f} s: {verdicts['valid']} valid, "
          f"{verdicts['length']} cut by the length limit, {verdicts['schema']} invalid")
    print(f"RESULT structured_valid_rate {verdicts['valid'] / num_schemas:.3f}")
    # the grammar's own share: of the outputs that finished, how many are valid (a length cut is the model looping)
    finished = verdicts["valid"] + verdicts["schema"]
    print(f"RESULT structured_valid_rate_of_finished {verdicts['valid'] / max(finished, 1):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64], help="none: skip the mask cost")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps timed per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    from elastic_hf import ElasticModel

    print(f"machine: {machine_description()}")
    model = ElasticModel.from_pretrained(None, dtype=args.dtype, max_model_len=1024, kv_cache_memory=512 << 20,
                                         max_num_seqs=max(args.batches, default=64), enable_prefix_caching=False)
    print(f"model: {model.model_id} ({model.config.dtype})")
    if args.batches:
        mask_cost(model, args.batches, args.tokens, args.runs)
    if args.schemas:
        valid_rate(model, args.schemas)
    model.close()


if __name__ == "__main__":
    main()
