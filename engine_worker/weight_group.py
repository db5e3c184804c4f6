"""A weight-update process group outside ``torch.distributed``'s default group.

The trainer (rank 0) and the workers meet at a TCPStore the trainer serves and build a process
group of their own (gloo on CPU, NCCL on GPUs), so a trainer that trains with torch.distributed
keeps its default group, and one push's failure ends only its own group. Every call blocks: callers
run them off the event loop (``asyncio.to_thread``). Every collective has a timeout.

The rendezvous (TCPStore) is not authenticated: bind it to an address only the fleet reaches.
torch is imported lazily: importing this module needs no torch.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
"""The tensor dtypes a push may carry (by name, as on the control stream)."""


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    torch_dtype(name)  # (refuses what a worker could not allocate)
    return name


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
        ``world_size`` ranks are there, or raises after ``timeout_s``."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(address, port, world_size, is_master=(rank == 0), timeout=timeout,
                              wait_for_workers=False)
        prefixed = dist.PrefixStore(name, store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":  # (untested here: needs a GPU per rank)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"backend {backend!r} is not gloo or nccl")
        return cls(name, rank, world_size, backend, timeout_s, store, pg)

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """Broadcast ``tensor`` from ``src`` in place (every rank calls it with a tensor of the same
        shape and dtype); raises when a peer is gone or after the timeout."""
        work = self._pg.broadcast(tensor, src, datetime.timedelta(seconds=self.timeout_s))
        try:
            work.wait()
        finally:
            del work  # (a failed call's traceback must not keep the group alive: see close)

    def close(self) -> None:
        """Leave: the other ranks' pending collectives with this one fail at once. (Dropping the
        last reference closes the group's sockets; ``shutdown()`` would leave the peers waiting
        until their timeout, seen with gloo on torch 2.13.)"""
        import gc

        self._pg = None
        self._store = None
        gc.collect()
