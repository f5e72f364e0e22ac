"""Models named by a Hugging Face Hub repo id ("org/name"), resolved through huggingface_hub exactly as transformers
resolves them: the cache under HF_HOME / HF_HUB_CACHE (or `download_dir`), HF_HUB_OFFLINE, a revision (branch, tag
or commit), a token from the environment (HF_TOKEN or `hf auth login`) unless one is given. Only what the engine
reads is fetched: configs, safetensors weights, tokenizer files (and Python files with trust_remote_code). Downloads
show huggingface_hub's own progress bars.

A snapshot directory of that cache (`.../models--org--name/snapshots/<commit>`) given as a path is named by its repo
id, not by its commit hash."""
from __future__ import annotations

import re
from pathlib import Path

# Files a checkpoint needs here; everything else of a repo (PyTorch .bin duplicates, ONNX, GGUF variants) stays
# on the Hub.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def looks_like_repo_id(name: str) -> bool:
    """"org/name" or "name" as the Hub spells repo ids (no path syntax: no leading '.', '/', '~', no '..')."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".gguf", ".json"))


def repo_id_of_snapshot(path: Path) -> str | None:
    """'org/name' for a snapshot directory of a Hub cache (the name a user knows), else None."""
    match = _SNAPSHOT.search(str(Path(path).resolve()).replace("\\", "/"))
    return f"{match['org']}/{match['name']}" if match else None


def hub_snapshot(repo_id: str, *, revision: str | None = None, cache_dir: str | None = None,
                 token: str | bool | None = None, trust_remote_code: bool = False,
                 tokenizer_only: bool = False) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (default: main), downloaded when missing and the
    Hub is reachable. Offline (HF_HUB_OFFLINE=1 or no network) a cached snapshot is used; a miss is one error that
    names the repo, the revision, the cache searched and how to fetch it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    patterns = list(TOKENIZER_PATTERNS if tokenizer_only else CHECKPOINT_PATTERNS)
    if trust_remote_code:
        patterns.append("*.py")   # the repo's own modeling / tokenizer code, run only when asked
    where = cache_dir or constants.HF_HUB_CACHE
    shown = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                 allow_patterns=patterns)
    except LocalEntryNotFoundError:
        fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "") + \
            (f" --cache-dir {cache_dir}" if cache_dir else "")
        raise FileNotFoundError(
            f"model {shown} is not in the Hugging Face cache {where} and the Hub cannot be reached"
            f"{' (HF_HUB_OFFLINE is set)' if constants.is_offline_mode() else ''}. Fetch it where the Hub is "
            f"reachable (`{fetch}`) and copy the cache here (HF_HOME or --download-dir), or pass a local "
            "checkpoint directory") from None
    except IncompleteSnapshotError as exc:
        raise FileNotFoundError(f"model {shown}: the cached snapshot in {where} is incomplete and the Hub cannot "
                                f"complete it: {exc}") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise FileNotFoundError(f"model {shown}: the Hub refused access ({type(exc).__name__}); check the name and "
                                "that your token (HF_TOKEN or `hf auth login`) may read it") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"model {repo_id} has no revision {revision!r} on the Hub") from None
    except HFValidationError as exc:
        raise FileNotFoundError(f"model {repo_id!r} is not a valid Hub repo id: {exc}") from None
    path = Path(path)
    if not tokenizer_only and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model {shown} has no .safetensors weights in {path}; elastic-hf reads safetensors "
                                "(convert the checkpoint with transformers' save_pretrained)")
    return path
