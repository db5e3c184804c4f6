"""New weights for a torch model that this process holds (the transformers engine).

Three sources, one swap: a trainer's broadcast over a weight-update group (received into
staging tensors, swapped only when the trainer commits the push), tensors handed over in the same
process, or a checkpoint directory. The swap copies every staged tensor into the model under the
engine's step lock, so it falls between two decode steps: requests in flight go on with the new
weights (in place) and every token records the version that made it. After an in-place swap the
new tokens attend to KV computed with the old weights; a trainer that minds masks or reweights
them by their per-token version.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Sequence

from redroll.engine_worker.engines.base import WeightsRefused
from redroll.engine_worker.engines.weight_group_member import WeightGroupMember
from redroll.shared.weight_group import joined, torch_dtype


class TorchWeights(WeightGroupMember):
    """Mixin: needs ``self._model``, ``self._step_lock``, ``self.info`` and ``self._jobs``."""

    _model: Any
    _step_lock: asyncio.Lock
    info: Any
    _staged: tuple[str, dict[str, Any]] | None = None

    # ------------------------------------------------------------ a trainer's broadcast

    async def receive_weights(self, specs: Sequence[Any], *, group_name: str, version: str,
                              in_place: bool = True) -> None:
        """Receive the broadcast tensors, in order, into staging (the model keeps serving)."""
        group = joined(self._group, group_name)
        import torch

        params = dict(self._model.named_parameters())
        buffers = []
        for spec in specs:
            self._check_fits(params, spec.name, list(spec.shape), spec.dtype)
            buffers.append((spec.name, torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))))

        await asyncio.to_thread(group.receive, [tensor for _, tensor in buffers])
        self._staged = (version, dict(buffers))

    async def commit_weights(self, version: str) -> None:
        """Swap what :meth:`receive_weights` staged for ``version`` into the model."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] != version:
            raise RuntimeError(f"no staged weights for version {version!r}")
        await self._swap(staged[1], version)

    async def discard_weights(self) -> bool:
        """Drop staged weights; the model was not touched (True: it still serves its version)."""
        self._staged = None
        return True

    # ------------------------------------------------------------ tensors in this process, a directory

    async def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> None:
        """Take ``named_tensors`` (a trainer in the same process: ``model.named_parameters()``) in place."""
        params = dict(self._model.named_parameters())
        staged = {}
        for name, tensor in named_tensors:
            self._check_fits(params, name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            staged[name] = tensor.detach().clone()
        await self._swap(staged, version)

    async def load_weights_in_place(self, model_path: str, version: str | None) -> None:
        """Load a checkpoint (off the loop) and swap it in between two steps."""
        previous = self.model_path  # type: ignore[attr-defined]
        self.model_path = model_path  # type: ignore[attr-defined]
        try:
            model, _tokenizer = await asyncio.to_thread(self._load)  # type: ignore[attr-defined]
        except Exception:
            self.model_path = previous  # type: ignore[attr-defined]
            raise
        await self._swap(dict(model.named_parameters()), version if version is not None else model_path)

    # ------------------------------------------------------------ the swap

    @staticmethod
    def _check_fits(params: dict[str, Any], name: str, shape: list[int], dtype: str) -> None:
        param = params.get(name)
        if param is None:
            raise WeightsRefused(f"the model has no parameter {name!r}")
        if list(param.shape) != shape:
            raise WeightsRefused(f"{name}: shape {shape} does not fit the model's {list(param.shape)}")
        torch_dtype(dtype)

    async def _swap(self, staged: dict[str, Any], version: str) -> None:
        import torch

        params = dict(self._model.named_parameters())
        for name, tensor in staged.items():  # all or nothing: check every tensor before the first copy
            self._check_fits(params, name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        async with self._step_lock:
            try:
                with torch.no_grad():
                    for name, tensor in staged.items():
                        params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
                self.info.weight_version = version
            finally:
                self._weights_changed()

    def _weights_changed(self) -> None:
        """Called under the step lock once the model's weights were (or may have been) written:
        an engine drops what it computed with the old ones (the transformers engine's prefix cache)."""
