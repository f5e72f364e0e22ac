"""Incremental detokenization with stop strings. Each sequence feeds its new tokens to its own
`tokenizers.decoders.DecodeStream`, so a step costs the same at token 10 and at token 8,000 (re-decoding the
whole output every step cost 18 us/token at 64 tokens and 878 us/token at 8k). Text that could still become a stop
string, and bytes of an unfinished UTF-8 character, are held back so a stream never emits text it later has to
take back.

Tokenizers without a Rust backend, or whose HF `decode` post-processes the backend's text
(`clean_up_tokenization_spaces`), decode the whole output instead: the text must be what `decode` gives."""
from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from elastic_hf.engine.sequence import Sequence

log = logging.getLogger(__name__)

_WHOLE = "whole"   # decode_stream marker: this sequence re-decodes its whole output (the stream gave up on it)


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.backend = backend if backend is not None and not cleans_up else None

    @property
    def is_incremental(self) -> bool:
        return self.backend is not None

    def update(self, seq: Sequence) -> bool:
        """Refresh seq.text after new tokens; returns True when a stop string ended the sequence."""
        settled = len(seq.decoded_text)
        self._decode_new_tokens(seq)
        text = seq.decoded_text
        stop = seq.params.stop
        # min_tokens: no stop string ends the output before it has that many tokens (vLLM's reading)
        if stop and seq.num_output_tokens >= seq.params.min_tokens:
            # Only the tail can hold a new match: search from just before the previously settled text.
            search_from = max(0, settled - max(len(s) for s in stop))
            hits = [(text.find(s, search_from), s) for s in stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                seq.text = text[:pos + len(s)] if seq.params.include_stop_str_in_output else text[:pos]
                return True
        seq.text = text
        return False

    def _decode_new_tokens(self, seq: Sequence) -> None:
        if self.backend is None or seq.decode_stream == _WHOLE:
            seq.decoded_text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            seq.num_decoded_tokens = seq.num_output_tokens
            return
        if seq.decode_stream is None:
            seq.decode_stream = DecodeStream(skip_special_tokens=True)
        pieces = []
        try:
            # only the new tokens: slicing the whole output here would make each step O(output length)
            for token in seq.token_ids[seq.num_prompt_tokens + seq.num_decoded_tokens:]:
                piece = seq.decode_stream.step(self.backend, token)
                seq.num_decoded_tokens += 1
                if piece is not None:   # None: the token ends inside a multi-byte character
                    pieces.append(piece)
        except Exception as exc:  # noqa: BLE001 - e.g. "Invalid prefix": the full decode is always right
            log.warning("incremental detokenization failed for sequence %d after %d tokens (%s); decoding its "
                        "whole output from now on", seq.seq_id, seq.num_decoded_tokens, exc)
            seq.decode_stream = _WHOLE
            self._decode_new_tokens(seq)
            return
        seq.decoded_text += "".join(pieces)

    def finish(self, seq: Sequence) -> None:
        """The final text of a sequence that ended by length or a stop token: a multi-byte character the stream
        still holds incomplete comes out as U+FFFD, as the full decode gives it (one decode per sequence)."""
        if self.backend is not None and seq.decode_stream not in (None, _WHOLE):
            seq.decoded_text = seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

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
