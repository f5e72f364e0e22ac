"""The repository stands on its own. A copy of the working tree in an empty directory, with nothing beside it, runs the
README's test command (set-up included) and passes, while an audit hook in every Python process of that run records
any file opened or directory listed outside the copy's own tree in the places a project could reach by accident (the
original checkout's parent, e.g. a `../shared` beside it, and the directory around the copy). The installed package
(not the checkout) runs `elastic-hf profile` without --calib: the calibration text ships inside it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSIDE_CLONE = "ELASTIC_HF_STANDALONE_CLONE"   # set in the inner run: do not recurse
GUARD = '''
import os, sys
_log = os.environ["ELASTIC_HF_GUARD_LOG"]
_allowed = os.environ["ELASTIC_HF_GUARD_ALLOWED"]
_forbidden = os.environ["ELASTIC_HF_GUARD_FORBIDDEN"].split(os.pathsep)

def _inside(path, root):
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

def _hook(event, args):
    if event not in ("open", "os.listdir", "os.scandir", "glob.glob") or not args:
        return
    path = args[0]
    if isinstance(path, int) or path is None:
        return
    try:
        path = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return
    if path == _log or _inside(path, _allowed) or not any(_inside(path, root) for root in _forbidden):
        return   # (the log itself: a checkout directly under /tmp puts it inside a forbidden place)
    with open(_log, "a") as f:  # the guard's own log lies outside the forbidden places
        f.write(f"{os.getpid()} {event} {path}\\n")

sys.addaudithook(_hook)
'''


def readme_test_command() -> str:
    """The second command of the README's quick start: set-up and tests."""
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^(bash scripts/setup\.sh && .*pytest.*)$", readme, flags=re.M)
    assert len(commands) == 1, f"the README must show exactly one set-up-and-test command, found {commands}"
    return commands[0]


def _working_tree_copy(dst: Path) -> None:
    """What a commit of the working tree would hold: tracked files plus untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():  # a deleted but still tracked file is not part of the tree
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)


def test_ci_runs_the_readme_test_command():
    assert readme_test_command() in (REPO / ".ci" / "run").read_text()


@pytest.mark.skipif(bool(os.environ.get(INSIDE_CLONE)), reason="already inside the standalone copy")
@pytest.mark.timeout(3000)
def test_readme_test_command_passes_in_a_copy_with_nothing_beside_it(tmp_path):
    outer = tmp_path / "empty"
    clone = outer / "elastic-hf"
    clone.mkdir(parents=True)
    _working_tree_copy(clone)
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD)
    log = tmp_path / "reads-outside.log"
    # Without PYTHONDONTWRITEBYTECODE Python keeps what the copy's processes compile in the copy's own venv, and
    # scripts/setup.sh skips byte-compiling every installed package first (that branch runs in CI's own set-up):
    # the smoke tier imports a fraction of them.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")}
    env.update({INSIDE_CLONE: "1", "PYTHONPATH": str(guard_dir), "ELASTIC_HF_GUARD_LOG": str(log),
                "ELASTIC_HF_GUARD_ALLOWED": str(clone),
                "ELASTIC_HF_GUARD_FORBIDDEN": os.pathsep.join([str(REPO.parent), str(outer)])})
    run = subprocess.run(["bash", "-c", readme_test_command()], cwd=clone, env=env, capture_output=True,
                         text=True, timeout=2900)
    # pip's set-up chatter first, pytest's report last, so a failure shows the report.
    noise = ("WARNING: Location", "DEPRECATION:")
    output = "\n".join(line for line in (run.stderr + run.stdout).splitlines() if not line.startswith(noise))
    assert run.returncode == 0, output[-6000:]
    assert re.search(r"\d+ passed", output), output[-2000:]
    reads = sorted(set(log.read_text().splitlines())) if log.exists() else []
    assert not reads, "the copy read files outside itself:\n" + "\n".join(reads[:40])


def test_profile_without_calib_runs_from_an_installed_package(tmp_path, tiny_checkpoint):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(REPO)], check=True, capture_output=True)
    out = tmp_path / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy shadows the editable checkout
    code = ("import sys, elastic_hf; from elastic_hf.serving.cli import main; "
            f"assert elastic_hf.__file__.startswith({str(site)!r}), elastic_hf.__file__; "
            "sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, "profile", str(tiny_checkpoint("llama")), "--out", str(out),
                          "--samples", "2", "--seq-len", "48", "--group-size", "32", "--awq-grid", "4",
                          "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # The shipped calibration text, named package-relative (a committed profile must not carry a machine's path);
    # the audit of elastic_hf.__file__ above shows it was the installed copy's.
    assert "from elastic_hf/data/wikitext2-valid.txt" in run.stdout
    assert out.is_file()
