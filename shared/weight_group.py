"""A weight-update process group outside ``torch.distributed``'s default group.

The trainer (rank 0) and the workers meet at a TCPStore the trainer serves and build a process
group of their own (gloo on CPU, NCCL on GPUs), so a trainer that trains with torch.distributed
keeps its default group, and one push's failure ends only its own group. Every call blocks: callers
run them off the event loop (``asyncio.to_thread``). Every collective has a timeout.

The rendezvous (TCPStore) is not authenticated: the trainer serves it on one address (its own
listening socket, since a TCPStore alone listens on every interface), which only the fleet should
reach.
torch is imported lazily: importing this module needs no torch.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
"""The tensor dtypes a push may carry (by name, as on the control stream)."""


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def _listen(address: str, port: int) -> int:
    """A listening socket bound to ``address`` only; its descriptor is handed to the TCPStore,
    which owns (and closes) it from then on."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    torch_dtype(name)  # (refuses what a worker could not allocate)
    return name


def joined(group: "WeightGroup | None", name: str) -> "WeightGroup":
    """``group`` when it is the push's group ``name``; a push for another group is refused."""
    if group is None or group.name != name:
        raise RuntimeError(f"not in weight-update group {name!r}")
    return group


@dataclass
class WeightGroup:
    """One process group: ``rank`` of ``world_size``, named ``name``."""

    name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    _store: Any = None
    _pg: Any = None

    @classmethod
    def open(cls, *, address: str, port: int, rank: int, world_size: int, name: str, backend: str = "gloo",
             timeout_s: float = 60.0) -> "WeightGroup":
        """Join (rank 0: serve) the rendezvous and connect to every other rank; blocks until all
        ``world_size`` ranks are there, or raises after ``timeout_s``.

        The store keys are those of SGLang's side of the group: its scheduler builds it with
        ``init_custom_process_group`` (sglang/srt/utils/common.py:2859-2927 of 0.5.23, called from
        model_executor/model_runner_components/weight_updater.py:100-141): a ``tcp://`` rendezvous,
        the store prefixed with the group name, then c10d's group helper, which prefixes
        ``<name>/`` and the first device's ``<device>/`` (gloo: cpu; nccl: cuda), builds the backend
        there and exchanges its sequence number. This builds the same
        backends on the same keys without registering the group in c10d's process-wide table, so
        a trainer and a worker may share a process, and one push reaches SGLang and transformers
        workers alike (``tests/test_weight_group.py`` checks it against c10d's helper)."""
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):  # (nccl is untested here: it needs a GPU per rank)
            raise ValueError(f"backend {backend!r} is not gloo or nccl")
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:  # serve the rendezvous on this one address (TCPStore alone listens on every interface)
            listen_fd = _listen(address, port)
            try:
                store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                                      wait_for_workers=False, master_listen_fd=listen_fd)
            except BaseException:
                os.close(listen_fd)
                raise
        else:
            store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        group_store = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
        device_map = dist.distributed_c10d.BackendConfig(dist.Backend(backend)).get_device_backend_map()
        first_device, device_backend = next(iter(device_map.items()))
        # One backend kind for every device (gloo, nccl): c10d builds it once, on the first
        # device's prefix, and serves every device with it.
        device_store = dist.PrefixStore(f"{first_device}/", group_store)
        if device_backend == "gloo":
            made = dist.ProcessGroupGloo(device_store, rank, world_size, timeout=timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            made = dist.ProcessGroupNCCL(device_store, rank, world_size, options)
        made._set_sequence_number_for_group()
        backends = {device: made for device in device_map}
        return cls(name, rank, world_size, backend, timeout_s, store, backends)

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """Broadcast ``tensor`` from ``src`` in place (every rank calls it with a tensor of the same
        shape and dtype, on the backend of its device); raises when a peer is gone or after the
        timeout."""
        import torch.distributed as dist

        backend = self._pg.get(tensor.device.type)
        if backend is None:
            raise ValueError(f"a {self.backend} weight group has no backend for {tensor.device.type} tensors")
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.timeout = datetime.timedelta(seconds=self.timeout_s)
        work = backend.broadcast([tensor], options)
        try:
            work.wait()
        finally:
            del work  # (a failed call's traceback must not keep the group alive: see close)

    def receive(self, tensors: Any) -> None:
        """Receive a push from rank 0: each tensor in turn, in place, in the trainer's order."""
        for tensor in tensors:
            self.broadcast(tensor, 0)

    def close(self) -> None:
        """Leave: the other ranks' pending collectives with this one fail at once. (Dropping the
        last reference closes the group's sockets; ``shutdown()`` would leave the peers waiting
        until their timeout, seen with gloo on torch 2.13.)"""
        import gc

        self._pg = None
        self._store = None
        gc.collect()
