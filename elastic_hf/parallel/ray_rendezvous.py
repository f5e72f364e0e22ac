"""What the Ray workers of a deployment share without a port of elastic-hf's own.

- The torch.distributed store is an async Ray actor (`StoreActor`, TCPStore's semantics) that workers reach over
  Ray's own channels: no unauthenticated store server listens anywhere. The only listeners beyond Ray's are gloo's
  (or NCCL's), on the interface that holds each node's Ray address (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set in
  a node's environment win).
- The host weight store is one per node (ReMP §3.4, across machines): a zero-CPU task pinned to the node reads
  the checkpoint from the node's own disk and returns the full Linear weights, which Ray keeps in that node's
  object store (shared memory); every worker of the node maps the same pages read-only. A node without the
  checkpoint gets a peer's copy, streamed by Ray's object manager."""
from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import warnings
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic_hf.parallel.rendezvous import interface_of, pin_collectives_to
from elastic_hf.parallel.weight_store import SharedWeightStore

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class StoreActor:
    """A torch.distributed key-value store: values are bytes; get and wait block until their keys exist."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.changed = asyncio.Condition()

    async def _until(self, keys: list[str], timeout_s: float) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: all(k in self.data for k in keys)), timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                missing = [k for k in keys if k not in self.data]
                raise TimeoutError(f"rendezvous keys {missing[:4]} not set within {timeout_s:.0f} s") from None

    async def _put(self, key: str, value: bytes) -> None:
        async with self.changed:
            self.data[key] = value
            self.changed.notify_all()

    async def set(self, key: str, value: bytes) -> None:
        await self._put(key, value)

    async def get(self, key: str, timeout_s: float) -> bytes:
        await self._until([key], timeout_s)
        return self.data[key]

    async def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        await self._put(key, str(value).encode())
        return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.data.get(key)
        if (current is None and expected == b"") or current == expected:
            await self._put(key, desired)
            return desired
        return expected if current is None else current

    async def wait(self, keys: list[str], timeout_s: float) -> None:
        await self._until(keys, timeout_s)

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.data)


def _seconds(timeout) -> float | None:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RayStore(dist.Store):
    """A worker's client of the StoreActor (what init_process_group and new_group read and write)."""

    def __init__(self, actor, timeout_s: float):
        super().__init__()
        self.actor = actor
        self.timeout_s = timeout_s

    def _call(self, method: str, *args, wait_s: float | None = None):
        ref = getattr(self.actor, method).remote(*args)
        try:
            return ray.get(ref, timeout=None if wait_s is None else wait_s + 30)
        except ray.exceptions.RayTaskError as exc:
            raise dist.DistStoreError(str(exc.cause if exc.cause is not None else exc)) from None

    def set(self, key, value) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key) -> bytes:
        return self._call("get", key, self.timeout_s, wait_s=self.timeout_s)

    def add(self, key, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def wait(self, keys, timeout=None) -> None:
        timeout_s = _seconds(timeout) or self.timeout_s
        self._call("wait", list(keys), timeout_s, wait_s=timeout_s)

    def check(self, keys) -> bool:
        return self._call("check", list(keys))

    def delete_key(self, key) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def set_timeout(self, timeout) -> None:
        self.timeout_s = _seconds(timeout)


_CLIENTS: list[RayStore] = []


@dataclass(frozen=True, slots=True)
class RayWorld:
    """One world of a Ray deployment (the parallel/rendezvous.LoopbackWorld of many nodes): the store actor and the
    world's key prefix."""
    actor: object
    prefix: str

    def store(self, timeout_s: float):
        client = RayStore(self.actor, timeout_s)
        # The C++ side calls back into the Python object, which must outlive it: the PrefixStore holds only the
        # C++ part, so this process keeps every client it made (one per world joined).
        _CLIENTS.append(client)
        return dist.PrefixStore(self.prefix, client)

    def pin_interfaces(self) -> None:
        ip = ray.util.get_node_ip_address()
        interface = interface_of(ip)
        if interface is None:
            log.warning("no network interface holds this node's Ray address %s: gloo/NCCL choose their own (set "
                        "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on the node)", ip)
            return
        pin_collectives_to(interface)


class RayRendezvous:
    """A store actor per world (the first, and the new one after a dead worker is replaced), preferably on the
    driver's node: a world's store dies with its node, and the next world does not depend on it."""

    def __init__(self):
        self.actor = None
        self._worlds = itertools.count()

    def new_world(self) -> RayWorld:
        self.close()
        here = ray.get_runtime_context().get_node_id()
        self.actor = StoreActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote()
        return RayWorld(self.actor, f"world{next(self._worlds)}/")

    def close(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None


@ray.remote(num_cpus=0, num_returns=2)
def _read_node_store(checkpoint_dir: str, hf_config, num_layers: int, dtype: torch.dtype):
    """On one node: the full Linear weights from the node's own copy of the checkpoint, as bytes for the node's
    object store, and the store's index (FileNotFoundError where the node has no copy)."""
    from elastic_hf.patches import get_adapter

    store = SharedWeightStore.from_checkpoint(checkpoint_dir, get_adapter(hf_config), num_layers, dtype, shared=False)
    return store.buffer.view(torch.uint8).numpy(), store.index


class NodeWeightStores:
    """One host weight store per node that runs workers. A worker's constructor gets the candidates for its node
    (`for_node`): its node's own store first, read there from the node's disk, then the stores of the other nodes,
    one of which Ray streams over if the node has no copy of the checkpoint. Nothing here waits: the stores are
    read while the workers import torch."""

    def __init__(self, checkpoint_dir: str, hf_config, dtype: torch.dtype):
        self.checkpoint_dir, self.hf_config, self.dtype = checkpoint_dir, hf_config, dtype
        self.stores: dict[str, list[ray.ObjectRef]] = {}   # node id -> [bytes, index]

    def for_node(self, node_id: str) -> list[list[ray.ObjectRef]]:
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        for gone in set(self.stores) - alive:   # its copy died with it (Ray would try to re-run a pinned task)
            del self.stores[gone]
        if node_id not in self.stores:
            self.stores[node_id] = _read_node_store.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                self.checkpoint_dir, self.hf_config, self.hf_config.num_hidden_layers, self.dtype)
        return [self.stores[node_id]] + [refs for node, refs in self.stores.items() if node != node_id]

    def release(self) -> None:
        self.stores.clear()   # Ray frees each node's copy with its last reference


class NodeStoreView:
    """A worker's host weight store, opened (open_node_store) at the first `get`: the worker loads its model while
    the node's store is still being read (the first get comes when the shards are placed)."""

    def __init__(self, candidates: list[list[ray.ObjectRef]], dtype: torch.dtype):
        self._candidates, self._dtype = candidates, dtype
        self._store: SharedWeightStore | None = None

    def get(self, layer_idx: int, kind: str) -> torch.Tensor:
        return self._opened().get(layer_idx, kind)

    def table(self, name: str) -> torch.Tensor | None:
        return self._opened().table(name)

    def _opened(self) -> SharedWeightStore:
        if self._store is None:
            self._store = open_node_store(self._candidates, self._dtype)
        return self._store


def open_node_store(candidates: list[list[ray.ObjectRef]], dtype: torch.dtype) -> SharedWeightStore:
    """A worker's view of the host weight store: the first candidate that exists (its node's own, else a peer's,
    copied into this node's object store by Ray), its pages mapped read-only, no copy."""
    for i, (array_ref, index_ref) in enumerate(candidates):
        try:
            index = ray.get(index_ref)
        except FileNotFoundError:   # Ray's task error is also the task's own exception type
            if i + 1 == len(candidates):
                raise
            log.warning("this node has no copy of the checkpoint: the weights stream from a peer's store")
            continue
        with warnings.catch_warnings():   # the pages are read-only and are only ever read (ShardedWeights copies)
            warnings.simplefilter("ignore", UserWarning)
            buffer = torch.from_numpy(ray.get(array_ref))
        return SharedWeightStore(buffer.view(dtype), index)
    raise ValueError("no weight store to open")
