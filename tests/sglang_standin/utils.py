"""``sglang/srt/utils/common.py`` (0.5.23): the two helpers of the weight-sync path.

``init_custom_process_group`` is SGLang's own (:2859-2927), kept line for line apart from the
branches SGLang does not take here (an explicit store, the pre-2.6 option name): it is how SGLang's
scheduler joins a trainer's weight-update group, so a push that reaches this stand-in reaches the
real one. ``MultiprocessingSerializer`` (:3060-3100) pickles with ``ForkingPickler`` (tensors travel
as shared-memory handles, or CUDA IPC handles on a GPU).
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any


def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None, device_id=None):
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      backend_options=pg_options, timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> Any:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        buf.seek(0)
        output = buf.read()
        if output_str:
            import base64

            output = base64.b64encode(output).decode("utf-8")
        return output

    @staticmethod
    def deserialize(data: Any) -> Any:
        if isinstance(data, str):
            import base64

            data = base64.b64decode(data, validate=True)
        return pickle.loads(data)  # (SGLang: a SafeUnpickler restricted to tensor rebuilds)
