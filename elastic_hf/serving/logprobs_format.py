"""The engine's token log-probabilities (`TokenLogprob`) in OpenAI's two shapes: chat's `logprobs.content` (one
entry per token with its bytes and top alternatives) and the legacy completions object (parallel lists of tokens,
log-probabilities, {token: logprob} alternatives and character offsets, prompt tokens first with `echo`).

Token strings are each token decoded on its own, as vLLM shows them: a byte-level token that is part of a
multi-byte character decodes to U+FFFD, and `bytes` carries what the token's own text encodes to."""
from __future__ import annotations

from elastic_hf.engine.outputs import TokenLogprob
from elastic_hf.serving import protocol as p


class LogprobFormatter:
    """Turns TokenLogprob records into response objects; caches token strings (the same ids recur every step)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- chat completions
    def chat(self, records: list[TokenLogprob]) -> p.ChatLogprobs:
        def entry(token_id: int, logprob: float, top=None):
            text = self.token(token_id)
            fields = {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
            return p.ChatTokenLogprob(**fields, top_logprobs=top) if top is not None else p.TopLogprob(**fields)

        return p.ChatLogprobs(content=[entry(r.token_id, r.logprob, [entry(t, lp) for t, lp in r.top])
                                       for r in records])

    # ---- completions
    def completion(self, records: list[TokenLogprob | None], text_offset: int = 0) -> p.CompletionLogprobs:
        """records: one per token (None for the first prompt token with echo); text_offset: where the first token's
        text starts in the choice's text (after an echoed prompt for the output part of a stream)."""
        out = p.CompletionLogprobs()
        for record in records:
            if record is None:   # the first prompt token: nothing predicts it
                continue
            text = self.token(record.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(record.logprob))
            # OpenAI lists the k most likely tokens; like vLLM the sampled one is always among them
            top = {self.token(t): _finite(lp) for t, lp in record.top}
            top.setdefault(text, _finite(record.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(text_offset)
            text_offset += len(text)
        return out

    def echoed_prompt(self, prompt_ids: list[int], records: list[TokenLogprob | None]) -> p.CompletionLogprobs:
        """The prompt part of an echo: its first token has no log-probability (null), as in OpenAI's API."""
        out = self.completion(records[1:], len(self.token(prompt_ids[0])) if prompt_ids else 0)
        if prompt_ids:
            out.tokens.insert(0, self.token(prompt_ids[0]))
            out.token_logprobs.insert(0, None)
            out.top_logprobs.insert(0, None)
            out.text_offset.insert(0, 0)
        return out


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is vLLM's stand-in for an impossible token.
    return max(logprob, -9999.0)


def joined(first: p.CompletionLogprobs, second: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """`second` appended to `first` (echoed prompt + completion), offsets of `second` shifted past `first`'s text."""
    shift = (first.text_offset[-1] + len(first.tokens[-1])) if first.tokens else 0
    return p.CompletionLogprobs(tokens=first.tokens + second.tokens,
                                token_logprobs=first.token_logprobs + second.token_logprobs,
                                top_logprobs=first.top_logprobs + second.top_logprobs,
                                text_offset=first.text_offset + [o + shift for o in second.text_offset])
