"""``redroll submit FILE.jsonl``: a batch run from JSON lines, with a progress bar."""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import IO, Any, Callable, Iterable

import msgspec
import redis

from redroll.cli.batch_resume import RunFile, move_records, records_written, write_all
from redroll.cli.runtime import collector_paused
from redroll.ops.control import live_workers
from redroll.producer.client import Producer, request_stream, send_each
from redroll.shared.codec import TOO_DEEP, Limits, ValidationError, check_unsent, request_from_values
from redroll.shared.connection import connect
from redroll.shared.errors import RedrollError
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import DuplicateRequestError
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest

ACCEPTED_FIELDS = {
    "request_id", "prompt", "input_ids", "sampling_params", "return_logprob", "collect_unfinished",
    "meta_info", "callback", "group_id", "affinity_key", "deadline", "lora_path", "model", "priority",
    "min_weight_version", "top_logprobs_num", "logprob_start_len", "return_routed_experts", "resumable",
    "messages", "tools", "return_text",
}


class InputError(RedrollError, ValueError):
    """A line of the input file is not a valid request (line number and reason in the message)."""


_parse_line = msgspec.json.Decoder().decode
"""One JSON line to plain values, in C: 1.2-2.8 us a line where ``json.loads`` took 4.5-6.9. Strict
JSON: ``NaN``, ``Infinity`` and lone surrogates (which ``json.dumps`` can write) are refused here,
where they would otherwise fail later or travel as values no JSON reader takes."""

_only_accepted_fields = msgspec.json.Decoder(msgspec.defstruct(
    "_AcceptedFields", [(name, msgspec.Raw, msgspec.Raw()) for name in sorted(ACCEPTED_FIELDS)],
    forbid_unknown_fields=True)).decode
"""Refuses a line that is not an object of accepted fields, without building any value (0.5 us)."""
_typed_request = msgspec.json.Decoder(GenerationRequest).decode


QUIET_CHECK_S = 10.0
"""With ``--wait``: after this many seconds with no record, progress is reported again and, when no
worker of the namespace is alive, that is said (once)."""

MAX_REPORTED = 20
"""The most bad lines :func:`read_requests` names in its :class:`InputError` (the rest are counted)."""


def read_requests(lines: Iterable[str], settings: Settings, source: str = "input") -> list[GenerationRequest]:
    """Parse and validate every line before anything is sent: a bad file sends nothing, and its
    :class:`InputError` names every bad line (one a line, up to :data:`MAX_REPORTED`)."""
    out: list[GenerationRequest] = []
    seen: set[str] = set()
    limits = settings.limits
    bad: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            req = request_from_line(line, limits)
        except InputError as exc:
            bad.append(f"{source}:{n}: {exc}")
            continue
        if req.request_id in seen:
            bad.append(f"{source}:{n}: request_id {req.request_id!r} appears twice")
            continue
        seen.add(req.request_id)
        out.append(req)
    if bad:  # every bad line in one run (up to MAX_REPORTED), not one a run
        more = len(bad) - MAX_REPORTED
        raise InputError("\n".join(bad[:MAX_REPORTED] + ([f"and {more} more bad line(s)"] if more > 0 else [])))
    return out


def request_from_line(line: str | bytes, limits: Limits) -> GenerationRequest:
    """One JSON line to a request checked as it will be sent (:class:`InputError` says why not).

    The usual line (accepted fields only, a ``request_id``, no nil where a value is required) is
    decoded straight into the Struct in C, 2.2 us where the plain values' path takes 8 or more;
    any other line takes that path, which names a missing ``request_id`` and drops nils as the
    wire does, and has the exact reason for a refusal. A property test holds the two paths to
    the same request or the same reason."""
    try:
        try:
            _only_accepted_fields(line)
            req = _typed_request(line)
        except msgspec.DecodeError:  # (msgspec.ValidationError is one too)
            return request_from_plain_values(line, limits)
        return check_unsent(req, limits)
    except ValidationError as exc:
        raise InputError(exc.reason) from None
    except RecursionError:  # (msgspec's JSON decoders recurse in C, as its MessagePack ones)
        raise InputError(f"invalid data: {TOO_DEEP}") from None


def request_from_plain_values(line: str | bytes, limits: Limits) -> GenerationRequest:
    """:func:`request_from_line` by way of the line's plain values: every line's meaning, and the reasons."""
    try:
        obj = _parse_line(line)
    except msgspec.DecodeError as exc:
        raise InputError(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError("each line must be a JSON object")
    unknown = obj.keys() - ACCEPTED_FIELDS
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(sorted(unknown))}")
    if obj.get("request_id") is None:  # (missing or null; an empty or non-string one is refused below)
        obj["request_id"] = uuid.uuid4().hex  # (as make_request names a request without one)
    try:
        return request_from_values(obj, limits)
    except ValidationError as exc:
        raise InputError(exc.reason) from None


async def submit_file(settings: Settings, path: str, *, wait: bool, out: str | None,
                      window: int = 1024, progress: bool = True, timeout: float | None = None,
                      resume: bool = False) -> int:
    """Submit every request of ``path``; with ``wait``, write one record per line. Returns an exit code.

    ``resume`` (with ``out``): take over the interrupted run that wrote ``out`` (see
    :mod:`redroll.cli.batch_resume`); the requests whose records are there already are not submitted again."""
    fh: IO[str] = sys.stdin if path == "-" else open(path, encoding="utf-8")
    # Reading makes no reference cycles: a collection would only walk the growing list of requests
    # (about 0.4 us a line). They live until the command ends, so none needs to walk them later.
    with collector_paused(), fh:
        requests = read_requests(fh, settings, source=path)
    if not requests:
        print(f"{path}: no requests", file=sys.stderr)
        return 1
    if not wait:
        return await _submit_only(settings, requests, window=window)
    if not out:
        failed, _ = await _submit_and_write(settings, requests, sys.stdout.buffer, window=window, progress=progress,
                                            timeout=timeout)
        return _said_failed(failed, len(requests))
    run = RunFile.open(out, settings.namespace, resume=resume)
    complete = False
    try:
        written = records_written(out) if resume else {}
        # (unbuffered: each batch is one write anyway, and a failed one leaves nothing behind in a
        # buffer for the close to write, or to fail on, later)
        with open(out, "ab" if resume else "wb", buffering=0) as sink:
            total = len(requests)
            failed_before = 0
            if resume:
                requests, failed_before = await _take_over(settings, run, requests, written, sink, out)
            if requests:
                failed, complete = await _submit_and_write(
                    settings, requests, sink, window=window, progress=progress, timeout=timeout,
                    producer_name=run.producer, on_start=lambda name: run.save(name, settings.namespace),
                    out=out)
            else:
                failed, complete = 0, True
    finally:
        run.close(complete=complete)
    return _said_failed(failed_before + failed, total)


def _said_failed(failed: int, count: int) -> int:
    if failed:
        print(f"{failed} of {count} request(s) did not finish (see their status and error)", file=sys.stderr)
    return 0 if not failed else 3


async def _take_over(settings: Settings, run: RunFile, requests: list[GenerationRequest], written: dict[str, bool],
                     sink: IO[bytes], out: str) -> tuple[list[GenerationRequest], int]:
    """``--resume``: write the records that reached the interrupted run's reply streams; return
    the requests that still have no record in OUT, and how many of the others did not finish
    (a record in OUT counts as the request's outcome, whatever its status)."""
    left = [req for req in requests if req.request_id not in written]
    moved: dict[str, bool] = {}
    if run.producer is not None and left:
        r = connect(settings)
        try:
            streams = [part.reply(run.producer) for part in settings.partition_keys]
            moved = await move_records(r, streams, {req.request_id for req in left}, set(written), sink)
        finally:
            await r.aclose()
    left = [req for req in left if req.request_id not in moved]
    failed = sum(1 for req in requests if not written.get(req.request_id, moved.get(req.request_id, True)))
    print(f"resuming {out}: {len(requests) - len(left) - len(moved)} record(s) there, {len(moved)} more from the "
          f"interrupted run's reply stream; {len(left)} request(s) to submit or take over"
          + (f" (as producer {run.producer})" if run.producer else ""), file=sys.stderr)
    return left, failed


async def _submit_only(settings: Settings, requests: list[GenerationRequest], *, window: int) -> int:
    """Queue ``requests`` for the consumer groups; each one Redis refuses is named (exit 3), the
    others are queued all the same."""
    refused = 0
    r = connect(settings)
    try:
        for i in range(0, len(requests), window):
            chunk = requests[i:i + window]
            for req, outcome in zip(chunk, await send_each(settings, r, chunk)):
                if isinstance(outcome, Exception):
                    print(f"{req.request_id}: not submitted: {outcome}", file=sys.stderr)
                    refused += 1
    finally:
        await r.aclose()
    parts = [settings.keys_for(req) for req in requests]
    queues = sorted({request_stream(part, req) for part, req in zip(parts, requests)})
    results = sorted({part.results for part in parts})
    print(f"submitted {len(requests) - refused} of {len(requests)} request(s) to {', '.join(queues)}; "
          f"records go to {', '.join(results)}")
    return 3 if refused else 0


async def _submit_and_write(settings: Settings, requests: list[GenerationRequest], sink: IO[bytes], *, window: int,
                            progress: bool, timeout: float | None, producer_name: str | None = None,
                            on_start: Callable[[str], None] | None = None,
                            out: str | None = None) -> tuple[int, bool]:
    """Submit ``requests`` and write each record as one JSON line as it arrives; returns how many
    did not finish, and whether every record came. Records are collected by the producer's
    callback and written (and flushed) a delivered batch at a time, before the producer acks their
    reply entries (so a kill at any instant leaves each record in the file or on its reply stream):
    one write, one flush and one progress refresh per batch, not per record. ``producer_name``: the
    producer to be (a resumed run's); ``on_start(name)`` runs once it is started, before anything
    is submitted."""
    encode = msgspec.json.Encoder().encode
    arrived: list[bytes] = []
    wake = asyncio.Event()
    failed = 0
    write_error: OSError | None = None

    def on_record(record: CompletionRecord) -> None:
        nonlocal failed
        if not record.ok:
            failed += 1
        arrived.append(encode(record))
        wake.set()

    def write_arrived() -> None:
        """Write the records that arrived (the producer's ``before_ack``, and on each wake-up); a
        failed write stops the run, with those records' entries left unacked."""
        nonlocal pending, settled, write_error
        if write_error is not None:
            raise write_error
        if not arrived:
            return
        batch = arrived[:]
        try:
            write_all(sink, b"\n".join(batch) + b"\n")
            sink.flush()
        except OSError as exc:
            write_error = OSError(exc.errno, f"writing the records to {out or 'stdout'} failed ({exc.strerror or exc})"
                                  + ("; those not written stay on the reply stream: --resume writes them"
                                     if out else ""))
            wake.set()
            raise write_error from exc
        del arrived[:len(batch)]
        pending -= len(batch)
        settled += len(batch)
        bar.advance(len(batch))

    pending = settled = 0  # (submitted, no record yet; and refused or written)
    async with Producer(settings, name=producer_name, tokens_from_ids=True, before_ack=write_arrived) as producer:
        if on_start is not None:
            on_start(producer.name)
        bar = _progress(len(requests), enabled=progress)
        try:
            for i in range(0, len(requests), window):
                chunk = requests[i:i + window]  # (validated whole by read_requests)
                try:
                    futures = await producer.submit_many(chunk, callback=on_record, validated=True)
                except (DuplicateRequestError, StreamRefusedError) as exc:  # (a chunk of one raises it)
                    futures = [asyncio.get_running_loop().create_future()]
                    futures[0].set_exception(exc)
                for fut, req in zip(futures, chunk):
                    if fut.done() and fut.exception() is not None:  # refused at submit: no record will come
                        print(f"{req.request_id}: not submitted: {fut.exception()}", file=sys.stderr)
                        failed += 1
                        settled += 1
                        bar.advance(1)
                    else:
                        pending += 1
                if write_error is not None:
                    raise write_error

            async def write_as_they_arrive() -> None:
                warned = False
                while pending:
                    # (asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
                    # that comes as the wait ends, and a Ctrl-C then did not stop the run)
                    try:
                        async with asyncio.timeout(QUIET_CHECK_S):
                            await wake.wait()
                    except TimeoutError:  # nothing arrived for a while: say so, and why if we can
                        bar.tick()
                        if not warned and not await _any_live_worker(producer.redis, settings):
                            warned = True
                            print(f"no live worker in namespace {settings.namespace!r}: the requests wait in the "
                                  "queue until one starts (is REDROLL_NAMESPACE / --namespace the workers' one?)",
                                  file=sys.stderr, flush=True)
                        continue
                    wake.clear()
                    write_arrived()

            try:
                async with asyncio.timeout(timeout):
                    await write_as_they_arrive()
            except TimeoutError:
                bar.close()
                print(f"timed out after {timeout:g} s: {pending} of {len(requests)} record(s) not received (their "
                      f"requests stay queued or in flight; `redroll abort` stops them"
                      + (f"; --resume takes them over and writes their records to {out}" if out else "") + ")",
                      file=sys.stderr)
                failed += pending
        except asyncio.CancelledError:  # (Ctrl-C: asyncio cancels the main task)
            if write_error is None:  # (records whose callbacks ran: into the file before it stops)
                write_arrived()
            bar.close()
            if out:
                then = (f"the same command with --resume takes them over (within reply_ttl_s, "
                        f"{settings.reply_ttl_s} s), writes their records to {out} and submits the rest")
            else:
                then = "a run started before they finish refuses their request_ids"
            print(f"interrupted: {pending} submitted request(s) have no record yet: they stay queued or in flight "
                  f"(`redroll abort` stops them) and their records go to {', '.join(producer.reply_streams)}, "
                  f"which nothing reads now; {then}; "
                  f"{len(requests) - settled - pending} request(s) were not submitted", file=sys.stderr)
            raise
        finally:
            bar.close()
    return failed, pending == 0


async def _any_live_worker(r: Any, settings: Settings) -> bool:
    """Whether a worker of the namespace is alive (True when Redis cannot say: no false alarm)."""
    try:
        return bool(await live_workers(r, settings.keys))
    except (redis.RedisError, OSError):
        return True


class _progress:
    """Progress on stderr: a rich bar with rate and ETA on a terminal; elsewhere (a log file, a
    pipe) a plain line every ``every_s`` seconds and one at the end, written as records arrive (no
    terminal codes, no refresh thread, rich not imported). Silent when disabled."""

    def __init__(self, total: int, enabled: bool = True, *, stream: IO[str] | None = None, every_s: float = 10.0):
        self._p = None
        self._plain: IO[str] | None = None
        self._total, self._done = total, 0
        if not enabled:
            return
        stream = sys.stderr if stream is None else stream
        self._t0 = asyncio.get_running_loop().time()
        if not _is_terminal(stream):
            self._plain, self._every_s, self._next_line = stream, every_s, self._t0 + every_s
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(TextColumn("records"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[rate]:>8.1f}/s"), TimeRemainingColumn(),
                           console=Console(file=stream), transient=False)
        self._p.start()
        self._task = self._p.add_task("records", total=total, rate=0.0)

    def advance(self, count: int = 1) -> None:
        if self._p is None and self._plain is None:
            return
        self._done += count
        now = asyncio.get_running_loop().time()
        elapsed = max(1e-6, now - self._t0)
        if self._p is not None:
            self._p.update(self._task, advance=count, rate=self._done / elapsed)
        elif now >= self._next_line:
            self._next_line = now + self._every_s
            self._line(elapsed)

    def tick(self) -> None:
        """Nothing arrived for a while: the plain line again (a bar refreshes itself)."""
        if self._plain is not None:
            now = asyncio.get_running_loop().time()
            self._next_line = now + self._every_s
            self._line(max(1e-6, now - self._t0))

    def _line(self, elapsed: float) -> None:
        assert self._plain is not None
        self._plain.write(f"records {self._done}/{self._total} {self._done / elapsed:,.1f}/s "
                          f"elapsed {elapsed:.1f} s\n")
        self._plain.flush()

    def close(self) -> None:
        """Stop the bar, or write the last line (once)."""
        if self._p is not None:
            self._p.stop()
            self._p = None
        elif self._plain is not None:
            self._line(max(1e-6, asyncio.get_running_loop().time() - self._t0))
            self._plain = None


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # (no isatty, or closed)
        return False
