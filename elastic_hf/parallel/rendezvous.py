"""Where a deployment's workers meet: a TCPStore served by the control-plane process on a socket it binds to
loopback itself (torch's own store server listens on every interface, whatever host it is given, and the store is
unauthenticated: anyone on the network could read or overwrite rendezvous keys and hang or hijack the worker
mesh), and the interfaces gloo and NCCL listen on pinned to loopback. Each world (the first, and the new one
after a dead worker is replaced) is a key prefix of the one store, so no port is ever picked, closed and hoped to
be free again."""
from __future__ import annotations

import datetime
import fcntl
import itertools
import os
import socket
import struct
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class LoopbackWorld:
    """What a worker needs to join one world of a single-host deployment: the loopback store's port and the
    world's key prefix. A multi-node executor hands its workers another kind of world with the same two methods
    (parallel/ray_rendezvous.py)."""
    port: int
    prefix: str

    def store(self, timeout_s: float):
        return join_store(self.port, self.prefix, timeout_s)

    def pin_interfaces(self) -> None:
        pin_collectives_to_loopback()


class Rendezvous:
    """The store server, in the process that starts the workers."""

    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((LOOPBACK, 0))
        self._socket.listen(128)
        self.port = self._socket.getsockname()[1]
        self.store = dist.TCPStore(LOOPBACK, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False, master_listen_fd=self._socket.fileno())
        self._socket.detach()   # the store server owns the listening socket now and closes it
        self._worlds = itertools.count()

    def new_world(self) -> LoopbackWorld:
        """A fresh world for the workers to join (a new key prefix of the one store)."""
        return LoopbackWorld(self.port, f"world{next(self._worlds)}/")

    def close(self) -> None:
        self.store = None   # the server stops and closes its socket


def join_store(port: int, prefix: str, timeout_s: float):
    """A worker's view of the store: a client of the loopback server, under its world's prefix."""
    import torch.distributed as dist

    client = dist.TCPStore(LOOPBACK, port, None, False, datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, client)


def pin_collectives_to_loopback() -> None:
    """gloo and NCCL's bootstrap listen on the loopback interface unless the user named one (multi-node set-ups
    set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME themselves)."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")
    pin_collectives_to(loopback)


def pin_collectives_to(interface: str) -> None:
    """gloo and NCCL on `interface` unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name one already."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is `ip` (None: none has it)."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:   # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(answer[20:24]) == ip:
                return name
    return None
