"""The checkpoint functions' calls (a mixin of :class:`~redroll.shared.scripts.Scripts`): a batch of
consolidating saves (``checkpoint_many.lua``) and a batch of parts (``save_parts.lua``), each one
fenced call of one hash tag."""

from __future__ import annotations

from typing import Any, Sequence

from redroll.shared import function_layouts as layouts
from redroll.shared.checkpoint_saves import CheckpointSave, PartSave, checkpoint_outcomes, checkpoint_refused
from redroll.shared.connection import large_argument
from redroll.shared.events import checkpoint_event, script_args
from redroll.shared.keys import events_key, submitted_as
from redroll.shared.streams import id_tuple


def _leases(keys: Sequence[str], entries: Sequence[str]) -> tuple[list[str], dict[str, int], list, list]:
    """The request streams of a batch (in order), each one's place (from 1), and per stream the
    first and last entry id of the batch's saves there (the lease range a call reads)."""
    streams = list(dict.fromkeys(keys))
    index = {stream: i for i, stream in enumerate(streams, 1)}
    leases = [sorted((e for k, e in zip(keys, entries) if k == stream), key=id_tuple) for stream in streams]
    return streams, index, [ids[0] for ids in leases], [ids[-1] for ids in leases]


class CheckpointCalls:
    """The checkpoint calls; the class that mixes it in gives ``events`` and ``run_layout``."""

    events: Any
    redis: Any
    run_layout: Any

    def checkpoint_many_in(self, client: Any, *, group: str, consumer: str, saves: Sequence[CheckpointSave],
                           ttl_s: int, chunks_ttl_s: int = 0) -> Any:
        """Queue (on a pipeline) or run one fenced call that appends every save of ``saves`` (all of
        one hash tag) to its checkpoint, and a streamed request's to its chunk stream (see
        checkpoint_many.lua). Its reply reads with :func:`checkpoint_outcomes`: per save (1, tokens
        now saved), (0, 'fenced' | 'stale') or (2, the error that refused it: nothing written)."""
        streams, index, lease_from, lease_to = _leases([s.requests_key for s in saves], [s.entry_id for s in saves])
        ev_cap, ev_ttl = script_args(self.events)
        args = {"group": group, "consumer": consumer, "part_ttl": ttl_s, "chunk_ttl": max(1, int(chunks_ttl_s)),
                "ev_cap": ev_cap, "ev_ttl": ev_ttl, "lease_from": lease_from, "lease_to": lease_to}
        items = []
        for save in saves:
            request_id = save.partial_key.split(":partial:", 1)[-1]
            flags = (("c" + ("t" if save.refresh_ttl else "") + ("o" if save.check_owner or not save.saved else ""))
                     if save.chunks_key and save.adding else "") + (
                "l" if save.logged and self.events is not None else "") + ("f" if save.length is not None else "")
            items.append({"partial": save.partial_key, "evkey": events_key(save.requests_key, request_id),
                          "chunks": save.chunks_key or save.partial_key, "ownkey": save.owner_key or save.partial_key,
                          "stream_at": index[save.requests_key], "entry": save.entry_id, "saved": save.saved,
                          "count": "%018d" % save.count, "part": large_argument(save.part),
                          "field": f"{request_id} {save.saved + save.prior_tokens} {save.adding}",
                          "submitted": submitted_as(save.requests_key, save.entry_id), "flags": flags or "-",
                          "event": checkpoint_event(consumer, save.requests_key, save.entry_id,
                                                    save.count, save.number) if "l" in flags else "-",
                          "length": "-" if save.length is None else save.length,
                          "prior": large_argument(save.prior)})
        return self.run_layout(layouts.CHECKPOINT_MANY, client, checkpoint_refused(len(saves)),
                               keys={"streams": streams}, args=args, items=items)

    async def checkpoint(self, *, requests_key: str, partial_key: str, group: str, consumer: str, entry_id: str,
                         saved: int, adding: int, part: bytes, ttl_s: int, chunks_key: str | None = None,
                         chunks_ttl_s: int = 0, owner_key: str | None = None,
                         logged: bool = True) -> tuple[int, int | str]:
        """One save (see :meth:`checkpoint_many_in`): ``part`` (``adding`` tokens) appended to the
        checkpoint that holds ``saved`` tokens, if this consumer owns the entry; with ``chunks_key``
        (a streamed request) also added to that chunk stream, kept ``chunks_ttl_s``, if ``owner_key``
        (the ownership hash of the producer whose reply stream it names) names the entry."""
        save = CheckpointSave(requests_key=requests_key, partial_key=partial_key, entry_id=entry_id, saved=saved,
                              adding=adding, part=part, chunks_key=chunks_key, owner_key=owner_key, logged=logged)
        reply = await self.checkpoint_many_in(self.redis, group=group, consumer=consumer, saves=[save], ttl_s=ttl_s,
                                              chunks_ttl_s=chunks_ttl_s)
        return checkpoint_outcomes(reply)[0]

    def save_parts_in(self, client: Any, *, group: str, consumer: str, parts_key: str, parts: Sequence[PartSave],
                      keep_ms: int, parts_ttl_s: int, chunks_ttl_s: int = 0) -> Any:
        """Queue (on a pipeline) or run one fenced call that adds every part of ``parts`` (all of one
        hash tag) to this worker's parts stream ``parts_key`` as one entry, and the streamed ones
        (``chunks_key`` set) to their producers' chunk streams (see save_parts.lua). Its reply reads
        with :func:`checkpoint_outcomes`: per part (1, 0), (0, 'fenced') or (2, the error that refused it)."""
        streams, index, lease_from, lease_to = _leases([p.requests_key for p in parts], [p.entry_id for p in parts])
        chunks: dict[str, bool] = {}
        for p in parts:
            if p.chunks_key:
                chunks[p.chunks_key] = chunks.get(p.chunks_key, False) or p.refresh_ttl
        at = {key: i for i, key in enumerate(chunks, 1)}
        items = [{"stream_at": index[p.requests_key], "entry": p.entry_id, "chunk_at": at.get(p.chunks_key or "", 0),
                  "field": f"{p.request_id} {p.before} {p.adding}", "data": large_argument(p.part)} for p in parts]
        args = {"group": group, "consumer": consumer, "keep_ms": int(keep_ms), "parts_ttl": int(parts_ttl_s),
                "chunk_ttl": max(1, int(chunks_ttl_s)), "lease_from": lease_from, "lease_to": lease_to,
                "refresh": ["1" if r else "0" for r in chunks.values()]}
        return self.run_layout(layouts.SAVE_PARTS, client, checkpoint_refused(len(parts)),
                               keys={"streams": streams, "parts": parts_key, "chunks": list(chunks)}, args=args,
                               items=items)


__all__ = ["CheckpointCalls"]
