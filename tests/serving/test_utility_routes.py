"""vLLM's utility routes on the real app: /version, /ping, /tokenize (prompt and chat messages), /detokenize, with
clear 4xx errors for bad input; and the package version from its metadata in one place."""
import httpx
import pytest


@pytest.fixture(scope="module")
def client(tiny_server):
    """httpx against the session's real server, with its API key (/tokenize and /detokenize run the tokenizer on
    the caller's input: they need it; /version and /ping do not)."""
    with httpx.Client(base_url=tiny_server.base_url, headers=tiny_server.headers, timeout=30) as http:
        yield http


def test_tokenizer_routes_need_the_api_key_and_probes_do_not(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as anonymous:
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})):
            response = anonymous.post(path, json=body)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert anonymous.get("/version").status_code == 200 and anonymous.get("/ping").status_code == 200


@pytest.fixture(scope="module")
def serving_tokenizer(serving_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(serving_checkpoint)


def test_version_matches_the_installed_metadata_and_the_cli(client):
    from importlib.metadata import version

    import elastic_hf
    from elastic_hf.serving.cli import build_parser

    assert elastic_hf.__version__ == version("elastic-hf")
    assert client.get("/version").json() == {"version": elastic_hf.__version__}
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200


def test_tokenize_and_detokenize_round_trip(client, serving_tokenizer):
    text = "The tower is 324 metres tall."
    body = client.post("/tokenize", json={"prompt": text}).json()
    assert body["tokens"] == serving_tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    strs = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == body["count"]
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == \
        serving_tokenizer.decode(body["tokens"])
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    expected = serving_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    assert chat["tokens"] == list(expected)


@pytest.mark.parametrize("path,payload,status,fragment", [
    ("/tokenize", {}, 400, "exactly one of prompt or messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "exactly one"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ("/detokenize", {"tokens": [1, -5, 10 ** 9]}, 400, "token ids must be in [0, "),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_input_is_a_clear_error(client, path, payload, status, fragment):
    response = client.post(path, json=payload)
    assert response.status_code == status and fragment in response.json()["error"]["message"], response.text
