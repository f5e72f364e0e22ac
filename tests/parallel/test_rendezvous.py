"""A deployment of worker processes listens on loopback only: the rendezvous store is served on a socket the
control plane binds to 127.0.0.1 itself (torch's store server binds every interface), and gloo listens on the
loopback interface; also after a dead worker is replaced (a new world on the same store). Every listening socket of
the process tree is read from /proc/net/tcp*."""
import os
import signal
import time

import pytest

from elastic_hf import ElasticModel

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}   # 127.0.0.1 and ::1 as /proc/net shows them


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _listening(pids, exclude: frozenset = frozenset()) -> list[tuple[str, str]]:
    """(address hex, port hex) of every LISTEN socket any of `pids` holds, but the inodes in `exclude`."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids)) - exclude
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:   # 0A: LISTEN
                out.append(tuple(fields[1].split(":")))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_workers_listen_on_loopback_only_also_after_a_replacement(tp_checkpoint):
    # Sockets this test process held before (other tests' servers in a full run) are not the deployment's.
    before = frozenset(_socket_inodes(os.getpid()))
    # TP2: both workers take part in every step, so the step after the kill finds the dead one
    with ElasticModel.from_pretrained(tp_checkpoint("kv3"), workers=2, tp=2, kv_cache_memory=1 << 20) as model:
        pids = [os.getpid(), *model.deployment.pool.pids()]
        listening = _listening(pids, before)
        assert listening, "no listener found: the check would pass vacuously"
        assert {address for address, _ in listening} <= LOOPBACK, listening
        reference = model.generate(list(range(10, 40)), max_tokens=6).outputs[0].token_ids
        os.kill(pids[2], signal.SIGKILL)             # a worker dies: its replacement joins a new world
        deadline = time.time() + 60
        while model.deployment.pool.pids()[1] == pids[2] and time.time() < deadline:
            try:
                model.generate(list(range(10, 40)), max_tokens=6)
            except Exception:   # noqa: BLE001 - the step that finds the dead worker may fail; recovery follows
                pass
        assert model.deployment.pool.pids()[1] != pids[2], "the dead worker was never replaced"
        assert model.generate(list(range(10, 40)), max_tokens=6).outputs[0].token_ids == reference
        listening = _listening([os.getpid(), *model.deployment.pool.pids()], before)
        assert {address for address, _ in listening} <= LOOPBACK, listening
