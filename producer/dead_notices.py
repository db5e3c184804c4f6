"""Learn of requests dead-lettered without an error record on their reply stream.

When a producer's reply stream cannot take entries (its ids exhausted, a key of another type),
the worker dead-letters the request once; the letter in ``{ns}:dead`` carries ``reply_to`` and
a ``reply_error`` field saying why no record could be sent. A producer watches the dead streams
(plain XREAD from where they stood when it started) for such letters naming its reply streams,
and resolves the waiting request with an ``error`` record built from the letter.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import redis
from redis.asyncio import Redis

from redroll.shared.streams import is_unblocked, text
from redroll.shared.types import CompletionRecord, RecordStatus

log = logging.getLogger("redroll.producer")


def notice_record(entry_id: str, fields: dict, reply_streams: set[str]) -> CompletionRecord | None:
    """The error record a dead letter stands for, when it names one of ``reply_streams`` and says
    its error record could not be sent there; else None."""
    reply_error = fields.get(b"reply_error")
    reply_to = fields.get(b"reply_to")
    rid = fields.get(b"rid")
    if reply_error is None or rid is None or reply_to is None or text(reply_to) not in reply_streams:
        return None
    reason = text(fields.get(b"reason", b""))
    return CompletionRecord(request_id=text(rid), status=RecordStatus.ERROR,
                            output_token_ids=[[]], finish_reasons=[None], error=reason,
                            meta_info={"dead_letter": entry_id, "reply_error": text(reply_error)})


async def start_positions(r: Redis, dead_streams: list[str]) -> dict[str, str]:
    """Each dead stream's newest id now: later letters are the ones to watch."""
    positions = {}
    for stream in dead_streams:
        last = await r.xrevrange(stream, count=1)
        positions[stream] = text(last[0][0]) if last else "0-0"
    return positions


async def watch(r: Redis, positions: dict[str, str], reply_streams: set[str],
                deliver: Callable[[CompletionRecord], Awaitable[None]], *, block_ms: int,
                closed: Callable[[], bool]) -> None:
    delay = 0.1
    while not closed():
        try:
            resp = await r.xread(positions, count=100, block=block_ms)
            for stream, entries in resp or []:
                for entry_id, fields in entries:
                    positions[text(stream)] = text(entry_id)
                    record = notice_record(text(entry_id), fields or {}, reply_streams)
                    if record is not None:
                        await deliver(record)
            delay = 0.1
        except asyncio.CancelledError:
            raise
        except redis.ResponseError as exc:
            if not is_unblocked(exc):
                log.warning("dead-letter watch: %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            log.warning("dead-letter watch: redis unavailable (%s); retrying in %.1fs", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        except Exception as exc:  # (a cluster client giving up mid-failover, a bug: the watch goes on)
            log.exception("dead-letter watch: %s; retrying in %.1fs", type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
