"""An engine's membership of a trainer's weight-update group (``weights_from_push``), for the
engines that receive a push themselves (the transformers and vLLM engines; SGLang joins through
its own API)."""

from __future__ import annotations

import asyncio

from redroll.shared.weight_group import WeightGroup


class WeightGroupMember:
    """Mixin: ``join_weight_group`` and ``leave_weight_group`` of the engine contract's
    :class:`~.base.PushedWeights`, over one :class:`WeightGroup` at a time."""

    _group: WeightGroup | None = None

    def _check_can_join(self) -> None:
        """Raise when this engine cannot join a group now (by default it can)."""

    async def join_weight_group(self, *, address: str, port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str, timeout_s: float) -> None:
        self._check_can_join()
        await self.leave_weight_group()
        self._group = await asyncio.to_thread(WeightGroup.open, address=address, port=port, rank=rank_offset,
                                              world_size=world_size, name=group_name, backend=backend,
                                              timeout_s=timeout_s)

    async def leave_weight_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close)
