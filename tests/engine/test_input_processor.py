"""The input processor (engine/input_processor.py): every check that does not depend on an instance happens here,
once, with the numbers in the message; text is tokenized once and token ids pass through as they are; chat goes
through the model's template."""
import pytest

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.input_processor import EngineRequest, InputProcessor
from elastic_hf.engine.sampling_params import SamplingParams


class CountingTokenizer:
    def __init__(self):
        self.num_encodes = 0

    def encode(self, text, add_special_tokens=True):
        self.num_encodes += 1
        return [1] + [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [1] + [len(m["content"]) for m in messages] + ([2] if add_generation_prompt else [])


@pytest.fixture
def processor():
    return InputProcessor(CountingTokenizer(), vocab_size=100, max_model_len=32, max_stop_strings=2,
                          max_stop_string_chars=5)


def test_text_is_tokenized_once_and_ids_pass_through(processor):
    request = processor.process("hello", SamplingParams(max_tokens=4), "r1", arrival_time=5.0)
    assert isinstance(request, EngineRequest) and processor.tokenizer.num_encodes == 1
    assert request.prompt_token_ids == [1, 4, 1, 8, 8, 11] and request.arrival_time == 5.0
    again = processor.process(request.prompt_token_ids, SamplingParams(max_tokens=4))
    assert again.prompt_token_ids == request.prompt_token_ids and processor.tokenizer.num_encodes == 1
    assert processor.render_chat([{"role": "user", "content": "abc"}]) == [1, 3, 2]


@pytest.mark.parametrize("prompt, params, message, param", [
    ([], SamplingParams(max_tokens=1), "prompt is empty", "prompt"),
    (list(range(33)), SamplingParams(max_tokens=1), "prompt has 33 tokens but max_model_len is 32", "prompt"),
    ([1] * 30, SamplingParams(max_tokens=3), "ask for at most 2 tokens", "max_tokens"),
    ([1, 100], SamplingParams(max_tokens=1), r"must be in \[0, 100\), got \[100\]", "prompt"),
    ([1], SamplingParams(max_tokens=1, stop=["a", "b", "c"]), "at most 2 stop strings", "stop"),
    ([1], SamplingParams(max_tokens=1, stop=["abcdef"]), "at most 5 characters, got one of 6", "stop"),
])
def test_bad_input_names_the_field_and_the_numbers(processor, prompt, params, message, param):
    with pytest.raises(InvalidRequest, match=message) as info:
        processor.process(prompt, params)
    assert info.value.param == param


def test_request_cost_limits_name_the_numbers():
    processor = InputProcessor(CountingTokenizer(), vocab_size=100, max_model_len=1 << 20, max_stop_token_ids=3,
                               max_request_output_cost=1000)
    with pytest.raises(InvalidRequest, match="at most 3 stop_token_ids are allowed, got 4"):
        processor.process([1, 2], SamplingParams(max_tokens=1, stop_token_ids=[5, 6, 7, 8]))
    with pytest.raises(InvalidRequest, match=r"n=4 x max_tokens=50 x \(1 \+ logprobs=5\) = 1200 exceeds .* 1000"):
        processor.process([1, 2], SamplingParams(max_tokens=50, n=4, logprobs=5))
    processor.process([1, 2], SamplingParams(max_tokens=50, n=4, logprobs=4))   # 1000: at the limit, accepted


def test_a_template_that_raises_is_an_invalid_request():
    """Chat templates refuse roles they lack with raise_exception (a jinja2 TemplateError): a 400, not a 500."""
    import jinja2

    class Refusing(CountingTokenizer):
        def apply_chat_template(self, messages, **kwargs):
            raise jinja2.exceptions.TemplateError("System role not supported")

    with pytest.raises(InvalidRequest, match="the chat template refused this conversation: System role"):
        InputProcessor(Refusing(), vocab_size=100, max_model_len=32).render_chat([{"role": "system",
                                                                                   "content": "x"}])


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("top_p", float("nan")),
                                          ("repetition_penalty", float("inf")), ("temperature", float("inf"))])
def test_non_finite_sampling_values_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})
    assert SamplingParams(temperature=3.7e-227).is_greedy   # below 1e-5: greedy, never a division overflow
