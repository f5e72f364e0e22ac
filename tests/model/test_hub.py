"""Hub repo ids resolve through huggingface_hub's cache exactly as transformers resolves them: a cache layout
(models--org--name/snapshots/<commit>, refs/<branch>) built here in a temporary directory, never the network
(offline mode): the main branch, a second branch and a commit; the served name is the repo id, also for a
snapshot path; an offline miss names the repo and how to fetch it."""
import os
import shutil
import subprocess
import sys

import pytest

from elastic_hf import ElasticModel
from elastic_hf.model.loader import load_hf_model, resolve_model
from greedy_reference import hf_greedy

MAIN, V2 = "a" * 40, "b" * 40   # commit hashes of two revisions


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_checkpoint):
    """A Hub cache holding org/tiny: main = the tiny Llama, branch v2 = the same shapes with other weights."""
    from tiny_models import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf-home")
    repo = root / "hub" / "models--org--tiny"
    other = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("v2") / "llama", seed=7)
    for commit, source in ((MAIN, tiny_checkpoint("llama")), (V2, other)):
        shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return root


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_repo_id_and_revisions_resolve_from_the_cache(hub_cache, offline):
    hub = str(hub_cache / "hub")
    main = resolve_model("org/tiny", download_dir=hub)
    assert main.checkpoint_dir.name == MAIN and main.model_id == "org/tiny" and main.dtype == "float32"
    assert resolve_model("org/tiny", revision="v2", download_dir=hub).checkpoint_dir.name == V2
    assert resolve_model("org/tiny", revision=V2, download_dir=hub).checkpoint_dir.name == V2
    # a snapshot directory given as a path is served by its repo id, not its commit hash
    assert resolve_model(main.checkpoint_dir).model_id == "org/tiny"


def test_from_pretrained_serves_each_revision_exactly(hub_cache, offline):
    hub = str(hub_cache / "hub")
    prompt = list(range(100, 130))
    tokens = {}
    for revision in (None, "v2"):   # v2 with its tokenizer named by repo id (--tokenizer)
        model = ElasticModel.from_pretrained("org/tiny", revision=revision, download_dir=hub, kv_cache_memory=4 << 20,
                                             tokenizer="org/tiny" if revision else None)
        assert model.model_id == "org/tiny"
        reference, _ = load_hf_model(model.checkpoint_dir)
        tokens[revision] = model.generate(prompt, max_tokens=8).outputs[0].token_ids
        assert tokens[revision] == hf_greedy(reference, prompt, 8)
    assert tokens[None] != tokens["v2"]   # two revisions, two models


def test_an_offline_miss_names_the_repo_and_the_fix(hub_cache, offline):
    hub = str(hub_cache / "hub")
    with pytest.raises(FileNotFoundError, match=r"org/absent is not in the Hugging Face cache .*HF_HUB_OFFLINE "
                                                r"is set.*`hf download org/absent --cache-dir"):
        resolve_model("org/absent", download_dir=hub)
    with pytest.raises(FileNotFoundError, match="org/tiny at revision 'v3' is not in the Hugging Face cache"):
        resolve_model("org/tiny", revision="v3", download_dir=hub)
    with pytest.raises(FileNotFoundError, match="neither a local checkpoint directory, a .gguf file nor a Hub"):
        resolve_model("./no/such/dir")


def test_hf_home_and_offline_come_from_the_environment(hub_cache):
    """A fresh process reads HF_HOME and HF_HUB_OFFLINE as transformers would (no download_dir given)."""
    env = {**os.environ, "HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = "from elastic_hf.model.loader import resolve_model; r = resolve_model('org/tiny'); print(r.checkpoint_dir)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"models--org--tiny/snapshots/{MAIN}")
