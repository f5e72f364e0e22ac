"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model writes its reasoning between <think> and
</think> before the answer; the parser moves that part to the message's `reasoning_content` (and stream deltas'), so
`content` is the answer alone. `deepseek_r1`: the chat template already opened <think> in the generation prompt, so
the output starts inside the reasoning; `qwen3`: the output opens it itself, or skips it (enable_thinking false)."""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    starts_inside: bool   # the template's generation prompt ends with <think>: the output begins in the reasoning

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output as (reasoning or None, content)."""
        opened = self.starts_inside
        if text.lstrip().startswith(START):
            text, opened = text.lstrip()[len(START):], True
        if not opened:
            return None, text
        reasoning, found, content = text.partition(END)
        return reasoning.strip("\n") or None, (content.lstrip("\n") if found else "")


class ReasoningStream:
    """One choice's stream: `feed(delta)` -> (reasoning delta, content delta); tags never reach the client and a
    tail that may still grow into one is held back until it is decided."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.pending = ""
        self.state = "inside" if parser.starts_inside else "undecided"

    def feed(self, delta: str, finished: bool = False) -> tuple[str | None, str | None]:
        self.pending += delta
        reasoning, content = "", ""
        while True:
            if self.state == "undecided":   # does the output open with <think>?
                stripped = self.pending.lstrip()
                if stripped.startswith(START):
                    self.pending, self.state = stripped[len(START):], "inside"
                    continue
                if START.startswith(stripped) and not finished:
                    break   # still possibly the tag
                self.state = "answer"
            if self.state == "inside":
                index = self.pending.find(END)
                if index >= 0:
                    reasoning += self.pending[:index]
                    self.pending, self.state = self.pending[index + len(END):], "answer_start"
                    continue
                keep = 0 if finished else _partial_suffix(self.pending, END)
                reasoning += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            if self.state == "answer_start":   # the newlines between </think> and the answer are neither
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.state = "answer"
            content += self.pending
            self.pending = ""
            break
        return reasoning or None, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
                     "qwen3": ReasoningParser("qwen3", starts_inside=False)}


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(sorted(REASONING_PARSERS))}") \
            from None
