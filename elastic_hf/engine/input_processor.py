"""The one place a request is tokenized and validated (vLLM's InputProcessor): a prompt (text, token ids or a chat
conversation through the model's template) and its SamplingParams become a validated `EngineRequest`, or an
InvalidRequest (a ValueError: HTTP 400) naming the field and the numbers. Nothing downstream tokenizes or
re-validates the prompt: the deployment routes the EngineRequest (a request that will be refused never triggers a
reshape) and the instance's engine only checks what depends on the instance (its KV capacity).

The server runs it on an input thread (AsyncEngine), off both the event loop and the engine thread; the Python API
runs it in the caller's thread. Stateless but for the tokenizer, which one input thread uses at a time."""
from __future__ import annotations

import time
from dataclasses import dataclass

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.grammar import CompiledGrammar, GrammarCompiler
from elastic_hf.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request that passed every check that does not depend on an instance."""
    request_id: str | None         # None: the deployment names it
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    grammar: CompiledGrammar | None = None   # params.structured_outputs compiled: each sequence gets its state


class InputProcessor:
    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, eos_token_ids: list[int] = (),
                 max_stop_strings: int = 64, max_stop_string_chars: int = 1024, max_stop_token_ids: int = 1024,
                 max_request_output_cost: int = 1 << 22, max_bad_words: int = 1024):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # structured output: compiled here, on the input thread, so the engine thread never waits for it
        self.grammars = GrammarCompiler(tokenizer, vocab_size, list(eos_token_ids))
        self.max_bad_words = max_bad_words
        self.max_model_len = max_model_len
        self.max_stop_strings = max_stop_strings
        self.max_stop_string_chars = max_stop_string_chars
        self.max_stop_token_ids = max_stop_token_ids
        self.max_request_output_cost = max_request_output_cost

    @classmethod
    def for_config(cls, config, tokenizer, vocab_size: int, max_model_len: int,
                   eos_token_ids: list[int]) -> "InputProcessor":
        """The limits of an EngineConfig (max_stop_strings, max_stop_string_chars, max_stop_token_ids,
        max_request_output_cost)."""
        return cls(tokenizer, vocab_size=vocab_size, max_model_len=max_model_len, eos_token_ids=eos_token_ids,
                   max_stop_strings=config.max_stop_strings, max_stop_string_chars=config.max_stop_string_chars,
                   max_stop_token_ids=config.max_stop_token_ids,
                   max_request_output_cost=config.max_request_output_cost)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation through the model's chat template, given `tools` (OpenAI's function
        definitions) and extra template variables (chat_template_kwargs, e.g. enable_thinking); ValueError for
        content it cannot take (also when the template refuses it with raise_exception, as chat templates do for
        roles they lack)."""
        import jinja2

        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False, **extra)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template refused this conversation: {exc}", param="messages") from None
        except TypeError as exc:   # e.g. None content concatenated by a template that expects text
            raise InvalidRequest(f"the chat template could not render this conversation: {exc}",
                                 param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding regardless
            ids = ids["input_ids"]
        return list(ids)

    def process(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                arrival_time: float | None = None) -> EngineRequest:
        prompt_ids = self.tokenize(prompt)
        self.check_prompt(prompt_ids, params)
        self.check_stop_strings(params)
        self.check_request_cost(params)
        self.check_token_ids(params)
        self.tokenize_bad_words(params)
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        return EngineRequest(request_id, prompt_ids, params, time.time() if arrival_time is None else arrival_time,
                             grammar)

    def check_token_ids(self, params: SamplingParams) -> None:
        for name, ids in params.token_ids_to_check().items():
            self._check_in_vocabulary(ids, f"{name}: token ids", name)

    def _check_in_vocabulary(self, ids: list[int], what: str, param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{what} must be in [0, {self.vocab_size}), got {bad[:5]}", param=param)

    def tokenize_bad_words(self, params: SamplingParams) -> None:
        """Each bad word as the token sequences it can appear as: alone and after a space (vLLM's reading)."""
        if len(params.bad_words) > self.max_bad_words:
            raise InvalidRequest(f"at most {self.max_bad_words} bad_words are allowed, got {len(params.bad_words)}",
                                 param="bad_words")
        sequences = set()
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    sequences.add(tuple(ids))
        params.bad_words_token_ids = [list(ids) for ids in sorted(sequences)]

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise InvalidRequest("prompt is empty: it must contain at least one token", param="prompt")
        if num_prompt > self.max_model_len:
            raise InvalidRequest(f"prompt has {num_prompt} tokens but max_model_len is {self.max_model_len}",
                                 param="prompt", code="context_length_exceeded")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"max_tokens={params.max_tokens} plus the prompt's {num_prompt} tokens exceeds "
                                 f"max_model_len={self.max_model_len}; ask for at most "
                                 f"{self.max_model_len - num_prompt} tokens", param="max_tokens",
                                 code="context_length_exceeded")
        self._check_in_vocabulary(prompt_ids, "prompt token ids", "prompt")

    def check_request_cost(self, params: SamplingParams) -> None:
        """What one request may ask the engine to do: stop token ids checked per sampled token, and the tokens and
        alternatives its choices produce."""
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequest(f"at most {self.max_stop_token_ids} stop_token_ids are allowed, got "
                                 f"{len(params.stop_token_ids)}", param="stop_token_ids")
        if params.output_cost > self.max_request_output_cost:
            raise InvalidRequest(f"n={params.n} x max_tokens={params.max_tokens} x (1 + logprobs="
                                 f"{params.logprobs or 0}) = {params.output_cost} exceeds this server's limit of "
                                 f"{self.max_request_output_cost} per request", param="n")

    def check_stop_strings(self, params: SamplingParams) -> None:
        """Stop strings are matched at every step of their request: their number and length are capped."""
        if len(params.stop) > self.max_stop_strings:
            raise InvalidRequest(f"at most {self.max_stop_strings} stop strings are allowed, got {len(params.stop)}",
                                 param="stop")
        longest = max((len(s) for s in params.stop), default=0)
        if longest > self.max_stop_string_chars:
            raise InvalidRequest(f"stop strings may have at most {self.max_stop_string_chars} characters, got one "
                                 f"of {longest}", param="stop")
