"""Small stream helpers shared by workers, producers and consumers."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any, Awaitable, Callable, Sequence

import redis
from redis.asyncio import Redis, RedisCluster


async def ensure_group(r: Redis, stream: str, group: str) -> bool:
    """Create ``group`` on ``stream`` from id 0 (MKSTREAM). Returns False when it already existed."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
        return True
    except redis.ResponseError as exc:
        if "BUSYGROUP" in str(exc):
            return False
        raise


async def ensure_groups(r: Any, streams: Sequence[str], group: str) -> int:
    """:func:`ensure_group` on each of ``streams`` in one round trip (a pipeline; a cluster client
    sends each node its part). Returns how many groups it created."""
    if not streams:
        return 0
    async with r.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xgroup_create(stream, group, id="0", mkstream=True)
        replies = await pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception) and "BUSYGROUP" not in str(reply):
            raise reply
    return sum(1 for reply in replies if not isinstance(reply, Exception))


def unique_consumer_name(role: str) -> str:
    """host-pid-random: unique per process start and never reused."""
    host = socket.gethostname().replace(" ", "_")[:40]
    return f"{role}-{host}-{os.getpid()}-{secrets.token_hex(3)}"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


async def read_group(r: Any, group: str, consumer: str, streams: Sequence[str], *, count: int,
                     block: int | None = None) -> list[tuple[str, list[tuple[str, dict]]]]:
    """``XREADGROUP GROUP group consumer COUNT count [BLOCK block] STREAMS <streams> > …``: the new
    entries as (stream, [(entry id, fields), …]) pairs, in the order of ``streams`` (those with
    entries), as redis-py's ``xreadgroup`` gives them but with text ids and stream names.

    On one server the reply is taken as the parser gives it: the command is named in bytes, which
    redis-py's reply callbacks are not keyed by, so none runs (its generic stream parsing cost about
    2 µs an entry). The cluster client routes by the command's name, so it gets the name as text
    and parses the reply itself. RESP3 answers a map, RESP2 (and redis-py's parsing) a list of
    pairs; all are read."""
    name: str | bytes = "XREADGROUP" if isinstance(r, RedisCluster) else b"XREADGROUP"
    args: list[Any] = [name, "GROUP", group, consumer, "COUNT", count]
    if block is not None:
        args += ["BLOCK", block]
    reply = await r.execute_command(*args, "STREAMS", *streams, *([">"] * len(streams)))
    return group_read_entries(reply, streams)


def group_read_entries(reply: Any, streams: Sequence[str]) -> list[tuple[str, list[tuple[str, dict]]]]:
    """An XREADGROUP reply as :func:`read_group` gives it (RESP2 or RESP3, as the parser gives it)."""
    if not reply:
        return []
    by_stream = {text(k): v for k, v in (reply.items() if isinstance(reply, dict) else reply)}
    return [(stream, [(text(entry_id), fields if isinstance(fields, dict) else script_fields(fields or []))
                      for entry_id, fields in entries])
            for stream in streams if (entries := by_stream.get(stream))]


def script_fields(flat: list) -> dict:
    """An entry's fields as a Lua script hands them back (a flat list), as the dict XREADGROUP gives."""
    pairs = iter(flat)
    return dict(zip(pairs, pairs))


READ_BYTES = 1 << 20
"""Record data a reader asks for in one read of a results or reply stream (see :func:`read_count`)."""


def data_size(fields: Any) -> int:
    """The bytes of an entry's ``data`` field (0 when it has none)."""
    if not fields:
        return 0
    data = fields.get(b"data")
    if data is None:
        data = fields.get("data")
    return len(data) if isinstance(data, (bytes, bytearray, str)) else 0


def read_count(entries: list, most: int, budget: int = READ_BYTES) -> int:
    """How many entries the next read asks for after ``entries`` ((id, fields) pairs): ``most``, or
    as many of the size just read (the mean of a few) as make up ``budget`` bytes (at least one).
    Redis builds a read's whole reply before it serves anyone else, so a read of a hundred large
    records (n × thousands of tokens with logprobs: hundreds of kB each) would hold it for tens of
    milliseconds."""
    if not entries:
        return most
    sample = entries[::max(1, len(entries) // 8)]  # (a size estimate: at most 9 entries looked at)
    size = sum(data_size(fields) for _id, fields in sample) / len(sample)
    return max(1, min(most, int(budget // size))) if size else most


def drop_read(read: asyncio.Task | None) -> None:
    """Drop a read asked for ahead and not awaited (an error, a stop): cancel it, and take its
    outcome once it ends, so that asyncio does not log it as never retrieved. Entries the server
    delivered to it stay pending for this reader. Returns None (``ahead = drop_read(ahead)``)."""
    if read is not None:
        read.cancel()
        read.add_done_callback(_take_outcome)


def _take_outcome(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def is_unblocked(exc: BaseException) -> bool:
    """A blocking read ended because its stream went away under it: on a cluster, the stream's
    slot moved to another node (the next read follows the redirection); or the stream was
    deleted. Reading again is the whole remedy."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("UNBLOCKED")


async def run_resilient(loop_fn: Callable[[], Awaitable[None]], *, stopping: asyncio.Event,
                        recreate_groups: Callable[[], Awaitable[None]], log: logging.Logger) -> None:
    """Run a process loop until it returns or ``stopping`` is set; on Redis errors back off and run
    it again (an outage never kills a worker or consumer), recreating consumer groups on NOGROUP
    (a restarted server without persistence)."""
    delay = 0.1
    while not stopping.is_set():
        try:
            await loop_fn()
            return
        except asyncio.CancelledError:
            raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            log.warning("%s: redis unavailable (%s); retrying in %.1fs", loop_fn.__name__, exc, delay)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                await recreate_groups()
                continue
            if is_unblocked(exc):
                log.info("%s: %s; reading again", loop_fn.__name__, exc)
                continue
            log.exception("%s: redis error", loop_fn.__name__)
        except Exception:
            log.exception("%s crashed; restarting it", loop_fn.__name__)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
