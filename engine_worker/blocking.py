"""A claim loop's blocking read that another task can cut short.

An idle worker waits for work in one ``XREADGROUP … BLOCK``. Each wait that times out costs
redis-server a command's parsing, blocking and unblocking (about 35-50 µs on this project's
machine), so a fleet of a thousand idle workers that each waited 1 s at a time kept Redis busy for
the waits alone. A long wait (:data:`IDLE_BLOCK_MS`) makes that cost small; it must then end
early, and cleanly, when the worker stops or its affinity lanes change (it must wait on other
streams). Cancelling the read would close its connection, and an entry Redis handed to the read
just before it saw the close would stay leased to this worker, unseen, until ``claim_idle``.

So the read runs on a connection of its own: with it goes ``CLIENT ID`` (one packet, so the
read has blocked, or answered, by the time the id is known), and :meth:`BlockingRead.interrupt`
sends ``CLIENT UNBLOCK <id> TIMEOUT`` from another connection: Redis answers the read as if its
time ran out, with nothing delivered. Where that is not possible (a cluster client, whose
connections belong to its nodes, or a role user without ``client|id``) the read waits
:data:`FALLBACK_BLOCK_MS` at most, as before.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import redis
from redis.asyncio.cluster import RedisCluster

from redroll.shared.streams import group_read_entries, read_group

log = logging.getLogger("redroll.worker")

IDLE_BLOCK_MS = 20_000
"""How long an idle worker's claim read waits when it can be cut short (its reply is awaited that
long and :data:`REPLY_MARGIN_S` more, whatever the connection's socket timeout)."""

REPLY_MARGIN_S = 10.0

FALLBACK_BLOCK_MS = 1_000
"""The longest wait of a read that cannot be cut short: what a stop or a change of lanes may wait."""


class BlockingRead:
    """``XREADGROUP GROUP group consumer COUNT n BLOCK ms STREAMS …`` of one claim loop."""

    def __init__(self, client: Any, group: str, consumer: str, *, block_ms: int | None = None):
        self.client = client
        self.group = group
        self.consumer = consumer
        self._given_block_ms = block_ms
        self.interruptible = not isinstance(client, RedisCluster)
        self._conn: Any = None
        self._client_id: int | None = None
        """The read's connection while a read is on its way (None otherwise)."""
        self._reading = False
        self._cut = False

    @property
    def block_ms(self) -> int:
        """How long a read waits: as given, else :data:`IDLE_BLOCK_MS` when it can be cut short."""
        if self._given_block_ms is not None:
            return self._given_block_ms
        return IDLE_BLOCK_MS if self.interruptible else FALLBACK_BLOCK_MS

    async def read(self, streams: Sequence[str], count: int,
                   block_ms: int | None = None) -> list[tuple[str, list[tuple[str, dict]]]]:
        """New entries as :func:`~redroll.shared.streams.read_group` gives them; waits up to
        ``block_ms`` (default :attr:`block_ms`) for the first, or until :meth:`interrupt`."""
        block = self.block_ms if block_ms is None else block_ms
        self._cut = False
        if not self.interruptible:
            return await read_group(self.client, self.group, self.consumer, streams, count=count,
                                    block=min(block, FALLBACK_BLOCK_MS))
        conn = self._conn
        if conn is None:
            conn = self._conn = await self.client.connection_pool.get_connection()
        args = (b"XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "BLOCK", block,
                "STREAMS", *streams, *([">"] * len(streams)))
        self._reading = True
        try:
            await conn.send_packed_command(conn.pack_commands([("CLIENT", "ID"), args]))
            try:
                self._client_id = int(await conn.read_response())
            except redis.ResponseError as exc:
                # A role user made before workers were granted CLIENT ID (or a server without it):
                # waits stay short.
                log.warning("this worker may not run CLIENT ID (%s): its idle claim reads wait %d ms at a time "
                            "(recreate its ACL user with `redroll acl apply` to let them wait longer)", exc,
                            FALLBACK_BLOCK_MS)
                self.interruptible = False  # (this read, on its way, still waits its time: once)
            if self._cut and self._client_id is not None:
                await self._unblock(self._client_id)
            reply = await conn.read_response(timeout=block / 1000.0 + REPLY_MARGIN_S)
        except BaseException:
            # (an error or a cancel: the connection may be in any state, the next read makes another)
            await self._drop()
            raise
        finally:
            self._reading = False
            self._client_id = None
        return group_read_entries(reply, streams)

    async def interrupt(self) -> None:
        """End the read on its way now (as if its time ran out); the next read waits again."""
        self._cut = True
        if self._reading and self._client_id is not None:
            await self._unblock(self._client_id)

    async def _unblock(self, client_id: int) -> None:
        try:
            await self.client.client_unblock(client_id)
        except redis.RedisError as exc:  # (the read then ends at its own time)
            log.warning("could not cut a claim read short: %s", exc)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.disconnect()
            finally:
                await self.client.connection_pool.release(conn)

    async def close(self) -> None:
        """Give the read's connection back to the pool (the worker closes the pool afterwards)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self.client.connection_pool.release(conn)
