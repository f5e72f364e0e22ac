"""Incremental detokenization with stop strings. Text that could still become a stop string, and bytes of an
unfinished UTF-8 character, are held back so a stream never emits text it later has to take back."""
from __future__ import annotations

from elastic_hf.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence) -> bool:
        """Refresh seq.text after new tokens; returns True when a stop string ended the sequence."""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        stop = seq.params.stop
        if stop:
            # Only the tail can hold a new match: search from just before the previously settled text.
            search_from = max(0, len(seq.text) - max(len(s) for s in stop))
            hits = [(text.find(s, search_from), s) for s in stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                seq.text = text[:pos + len(s)] if seq.params.include_stop_str_in_output else text[:pos]
                return True
        seq.text = text
        return False

    @staticmethod
    def emittable_length(seq: Sequence, finished: bool) -> int:
        """How much of seq.text may be streamed now."""
        text = seq.text
        if finished:
            return len(text)
        end = len(text)
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            end -= 1
        if seq.params.stop:
            end = max(seq.num_emitted_chars, end - (max(len(s) for s in seq.params.stop) - 1))
        return max(end, seq.num_emitted_chars)
