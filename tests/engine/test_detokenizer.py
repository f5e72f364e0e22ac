"""Incremental detokenization (tokenizers' DecodeStream per sequence) gives exactly the text of a full decode, for
real text with multi-byte characters and for random token ids (invalid UTF-8 included), and never re-decodes the
whole output while a sequence runs."""
import random

import pytest

from elastic_hf.engine.detokenizer import Detokenizer
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.sequence import Sequence


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from elastic_hf.model.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None, dtype="float32").checkpoint_dir)


class CountingTokenizer:
    """The real tokenizer, counting calls to decode (the O(output length) path)."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces
        self.decodes = 0

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self.inner.decode(ids, **kwargs)


def feed(detokenizer: Detokenizer, ids: list[int], **params) -> tuple[Sequence, list[str]]:
    """Feed ids one at a time as the engine does; returns the sequence and the text after every token."""
    seq = Sequence(0, "r", 0, [1], 1, SamplingParams(**params), 0.0)
    texts = []
    for token in ids:
        seq.token_ids.append(token)
        stopped = detokenizer.update(seq)
        texts.append(seq.text)
        if stopped:   # the engine ends the sequence at its stop string
            return seq, texts
    detokenizer.finish(seq)
    return seq, texts


def test_incremental_text_equals_full_decode(tokenizer):
    text = ("The Roman Empire — in Latin Imperium Romanum — spanned three continents. Ünïcödé: 日本語のテキスト, "
            "emoji 🚀🎉, and code: def f(x):\n    return x ** 2\n")
    ids = tokenizer.encode(text * 3, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detokenizer = Detokenizer(counting)
    assert detokenizer.is_incremental
    seq, texts = feed(detokenizer, ids)
    assert seq.text == tokenizer.decode(ids, skip_special_tokens=True) == text * 3
    assert counting.decodes == 1   # only the final check at finish, never per step
    for i in range(0, len(ids), 7):   # every prefix's text is a prefix of the final text
        assert (seq.text.startswith(texts[i]))


def test_random_ids_match_full_decode(tokenizer):
    detokenizer = Detokenizer(tokenizer)
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        seq, _ = feed(detokenizer, ids)
        assert seq.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_found_across_tokens(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    seq, _ = feed(Detokenizer(tokenizer), ids, stop=["gamma d"])
    assert seq.text == "alpha beta "
