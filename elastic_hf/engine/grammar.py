"""Structured output on llguidance (vLLM's `guidance` backend): constraints compiled to token matchers, one
matcher per sequence advanced by every accepted token, and per step one int32 bitmask of the allowed tokens of
every constrained row, applied to the logits where they are sampled (engine/sampler.py).

Why llguidance rather than xgrammar (vLLM's default): measured side by side on the default model's 49k-token
vocabulary, a JSON schema compiles in ~2 ms (xgrammar ~9 ms) and a mask costs ~25 us a token (xgrammar ~7 us), both
far below a decode step (benchmarks/structured_output.py: 1.5 ms of a 200 ms batch-64 step; length-bounded strings
are llguidance's costly case, ~0.3 ms a row); but xgrammar requires triton on Linux x86 (a 1 GB wheel, for GPU
kernels a CPU engine never runs) while llguidance is one 3 MB wheel with no dependencies, and it takes GBNF, Lark,
regex and JSON schema natively."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.structured_outputs import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256
# I-JSON's integer range (RFC 7493 2.2: beyond it, parsers such as JavaScript's lose precision), given to integers
# a schema leaves unbounded: a small model can otherwise repeat a digit until the length limit
_SAFE_INTEGER = 2 ** 53 - 1
# JSON is generated compact, as json.dumps writes it: with free whitespace small models can loop on newlines until
# the length limit (vLLM's disable_any_whitespace)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarState:
    """One sequence's position in its constraint: which tokens may come next, advanced by each accepted token."""

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def consume(self, token: int) -> bool:
        """False when the constraint does not allow `token` (the mask should have prevented it)."""
        return self.matcher.consume_token(token)

    def is_stopped(self) -> bool:
        """The constraint is complete and allows nothing more: the sequence ends here."""
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()


class CompiledGrammar:
    """One compiled constraint; `state()` gives each sequence its own (a copy of a fresh prototype matcher)."""

    def __init__(self, prototype, key: tuple[str, str], vocab_size: int):
        self._prototype = prototype
        self.key = key
        self.vocab_size = vocab_size

    def state(self) -> GrammarState:
        return GrammarState(self._prototype.deep_copy(), self.vocab_size)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; thread-safe, cached by constraint (LRU)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size          # the logits' width (may exceed the tokenizer's vocabulary)
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._ll_tokenizer is None:   # ~0.5 s for a 49k vocabulary: once per process, on first use
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """InvalidRequest naming the request field and llguidance's reason for a constraint it cannot compile."""
        key = spec.cache_key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            compiled = CompiledGrammar(self._build(spec), key, self.vocab_size)
            self._cache[key] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return compiled

    def _build(self, spec: StructuredOutputsParams):
        import llguidance
        from llguidance import grammar_from

        kind, text = spec.kind, spec.text()
        try:
            if kind in ("json", "json_object"):
                grammar = llguidance.LLMatcher.grammar_from_json_schema(interoperable_integers(json.loads(text)),
                                                                        overrides=_JSON_OPTIONS)
            elif kind == "regex":   # \d, \w, \s as ASCII classes, as xgrammar and outlines read them
                grammar = llguidance.LLMatcher.grammar_from_regex(llguidance.regex_to_lark(text, "dws"))
            else:
                grammar = grammar_from(kind, text)
        except (ValueError, RecursionError) as exc:   # JSONDecodeError is a ValueError
            raise InvalidRequest(f"{spec.param}: invalid {kind}: {exc}", param=spec.param) from None
        tokenizer = self._tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequest(f"{spec.param}: invalid {kind}: {error.strip()[:500]}", param=spec.param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{spec.param}: invalid {kind}: {matcher.get_error()[:500]}", param=spec.param)
        return matcher


def interoperable_integers(schema):
    """A copy of `schema` in which every integer without a lower / upper bound gets I-JSON's."""
    if isinstance(schema, list):
        return [interoperable_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: interoperable_integers(value) for key, value in schema.items()}
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _SAFE_INTEGER
    return out


# ---------------------------------------------------------------- per-step masks
def fill_bitmasks(states: list[GrammarState]) -> torch.Tensor:
    """The allowed next tokens of each state: int32 [len(states), ceil(vocab / 32)], filled on the calling thread.
    llguidance's parallel executor was measured slower here: right after a forward pass its threads compete with
    torch's OpenMP threads, which spin-wait on every core (17 ms a step at batch 64 on 2 cores, against 1.4 ms
    sequentially)."""
    bitmask = torch.full((len(states), (states[0].vocab_size + 31) // 32), -1, dtype=torch.int32)
    row_bytes = bitmask.shape[1] * 4
    base = bitmask.data_ptr()
    for row, state in enumerate(states):
        state.matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
    return bitmask
