"""The default model through the chat template: a real answer, and the same tokens as HF on the same ids."""
import pytest

from greedy_reference import hf_greedy


@pytest.mark.slow
def test_default_model_answers_through_chat_template(default_model, default_reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = default_model.chat(messages, max_tokens=24)
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in completion.text
    prompt_ids = default_model.apply_chat_template(messages)
    assert out.prompt_token_ids == prompt_ids
    assert completion.token_ids == hf_greedy(default_reference, prompt_ids, 24)
