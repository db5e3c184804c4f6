"""``redroll submit --wait --out OUT --resume``: taking over an interrupted run (redroll/cli/batch_resume.py)."""

from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest

from redroll.cli.batch_resume import RUN_SUFFIX, ResumeError, RunFile, records_written
from redroll.cli.batch_run import submit_file
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from tests.conftest import running, wait_until


def _requests(path, ids, tokens: int = 10) -> None:
    path.write_text("".join(json.dumps({"request_id": rid, "prompt": "x", "sampling_params":
                                        {"max_new_tokens": tokens}}) + "\n" for rid in ids))


def _written(out) -> list[str]:
    return [json.loads(line)["request_id"] for line in out.read_bytes().splitlines()]


async def _interrupted_run(settings, src, out, at_least: int) -> None:
    """Run ``submit --wait --out`` until ``at_least`` records are in ``out``, then cancel it (Ctrl-C)."""
    task = asyncio.create_task(submit_file(settings, str(src), wait=True, out=str(out), progress=False))
    await wait_until(lambda: out.exists() and len(out.read_bytes().splitlines()) >= at_least, timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("partitions", [1, 3])
async def test_a_resumed_run_writes_every_record_once_and_generates_nothing_twice(settings, r, tmp_path, capsys,
                                                                                  partitions):
    settings = settings.with_(partitions=partitions)  # (3: a reply stream in each partition)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"r-{i}" for i in range(40)]
    _requests(src, ids, tokens=30)  # (6 s of work: a slow machine still interrupts the run midway)
    worker = Worker(settings, SyntheticEngine(token_ms=20), max_inflight=4)
    async with running(worker):
        await _interrupted_run(settings, src, out, at_least=8)
        run_file = json.loads((tmp_path / ("out.jsonl" + RUN_SUFFIX)).read_text())
        assert run_file["namespace"] == settings.namespace
        before, first = len(_written(out)), out.read_bytes()
        # records keep reaching the interrupted run's reply stream while nothing reads it
        replies = [part.reply(run_file["producer"]) for part in settings.partition_keys]
        await wait_until(lambda: _xlen_at_least(r, replies, 4), timeout=30)
        capsys.readouterr()
        code = await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=60, resume=True)
    assert code == 0
    written = _written(out)
    assert sorted(written) == sorted(ids) and out.read_bytes().startswith(first)  # (appended)
    # the requests still queued or in flight were taken over, not submitted again: 40 generations in all
    assert worker.stats.published == 40
    err = capsys.readouterr().err
    assert f"resuming {out}: {before} record(s) there, " in err and f"(as producer {run_file['producer']})" in err
    assert not (tmp_path / ("out.jsonl" + RUN_SUFFIX)).exists()  # every record is in OUT: nothing to resume
    assert [await r.xlen(x) for x in replies] == [0] * partitions  # (each record acked and deleted once written)


async def _xlen_at_least(r, keys: list[str], n: int) -> bool:
    return sum([await r.xlen(key) for key in keys]) >= n


async def test_a_resume_submits_what_the_interrupted_run_never_did(settings, tmp_path):
    """Lines the interrupted run did not submit (here: added to the file since) are submitted."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(src, [f"a-{i}" for i in range(12)], tokens=4)
    worker = Worker(settings, SyntheticEngine(token_ms=20), max_inflight=2)
    async with running(worker):
        await _interrupted_run(settings, src, out, at_least=2)
        _requests(src, [f"a-{i}" for i in range(20)], tokens=4)
        assert await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=60,
                                 resume=True) == 0
    assert sorted(_written(out)) == sorted(f"a-{i}" for i in range(20)) and worker.stats.published == 20


class _FillingFile:
    """OUT on a disk that fills up: after ``room`` writes, one takes all but the last byte of what
    it is given (the last blocks), and the next ones fail (ENOSPC)."""

    def __init__(self, fh, room: int):
        self._fh, self.room = fh, room

    def write(self, data) -> int:
        self.room -= 1
        if self.room < -1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._fh.write(data if self.room >= 0 else data[:-1])

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


async def test_a_record_that_could_not_be_written_stays_on_its_reply_stream_for_the_resume(
        settings, r, tmp_path, monkeypatch):
    """OUT's disk fills up: the run stops with the reason and what to do, and the records it could
    not write were not acked (a batch is written and flushed before its reply entries are acked),
    so ``--resume`` writes them from the reply stream; nothing is generated twice."""
    import redroll.cli.batch_run

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"d-{i}" for i in range(30)]
    _requests(src, ids, tokens=4)
    worker = Worker(settings, SyntheticEngine(token_ms=5), max_inflight=2)
    async with running(worker):
        def open_out_on_a_full_disk(path, *args, **kw):
            return _FillingFile(open(path, *args, **kw), room=1) if path == str(out) else open(path, *args, **kw)

        monkeypatch.setattr(redroll.cli.batch_run, "open", open_out_on_a_full_disk, raising=False)
        with pytest.raises(OSError, match=r"writing the records to .*out.jsonl failed \(No space left on device\); "
                                          r"those not written stay on the reply stream: --resume writes them"):
            await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=60)
        monkeypatch.undo()
        assert not out.read_bytes().endswith(b"\n")  # (a record cut short: the resume cuts it off)
        assert 0 < len(records_written(str(out))) < len(ids)
        await wait_until(lambda: worker.stats.published == len(ids), timeout=30)
        assert await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=60,
                                 resume=True) == 0
    assert sorted(_written(out)) == sorted(ids) and worker.stats.published == len(ids)


async def test_a_finished_run_resumed_submits_nothing(settings, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(src, ["f-0", "f-1"], tokens=2)
    async with running(Worker(settings, SyntheticEngine())):
        assert await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=30) == 0
    assert not (tmp_path / ("out.jsonl" + RUN_SUFFIX)).exists()
    first = out.read_bytes()
    assert await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=5, resume=True) == 0
    assert out.read_bytes() == first and "2 record(s) there, 0 more" in capsys.readouterr().err


async def test_the_exit_status_of_a_resumed_run_is_that_of_the_whole_file(settings, tmp_path, capsys):
    """A record in OUT is its request's outcome, whatever its status: not submitted again, and
    counted when it did not finish."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(src, ["ok-0", "bad-0", "new-0"], tokens=2)
    out.write_text(json.dumps({"request_id": "ok-0", "status": "finished"}) + "\n"
                   + json.dumps({"request_id": "bad-0", "status": "error", "error": "engine failed"}) + "\n")
    async with running(Worker(settings, SyntheticEngine())):
        code = await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=30, resume=True)
    assert code == 3 and _written(out) == ["ok-0", "bad-0", "new-0"]
    assert "1 of 3 request(s) did not finish" in capsys.readouterr().err


async def test_a_new_run_over_an_interrupted_one_is_refused_without_resume(settings, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(src, ["x-0"])
    async with Producer(settings) as p:  # (no worker: the request stays queued)
        run = RunFile.open(str(out), settings.namespace, resume=False)
        run.save(p.name, settings.namespace)
        run.close(complete=False)
    out.write_bytes(b"")
    with pytest.raises(ResumeError, match="add --resume to take them over, or delete .*out.jsonl.run"):
        await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=5)
    with pytest.raises(ResumeError, match="namespace"):
        await submit_file(settings.with_(namespace=settings.namespace + "-other"), str(src), wait=True, out=str(out),
                          progress=False, timeout=5, resume=True)


def test_one_run_at_a_time_writes_an_output(tmp_path):
    out = str(tmp_path / "out.jsonl")
    first = RunFile.open(out, "ns", resume=False)
    try:
        with pytest.raises(ResumeError, match="being written by another redroll submit"):
            RunFile.open(out, "ns", resume=True)
    finally:
        first.close(complete=False)
    assert not os.path.exists(out + RUN_SUFFIX)  # (nothing was submitted: no run to resume)
    RunFile.open(out, "ns", resume=False).close(complete=False)  # (unlocked again)


def test_records_written_cuts_off_a_record_cut_short(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = b'{"request_id": "a", "status": "finished"}\n{"status": "error", "request_id": "b", "error": "x"}\n'
    out.write_bytes(whole + b'{"request_id": "c", "status": "finished", "outp')
    assert records_written(str(out)) == {"a": True, "b": False}  # (request_id: finished)
    assert out.read_bytes() == whole
    assert records_written(str(tmp_path / "missing.jsonl")) == {}


@pytest.mark.parametrize("body", [b'{"request_id": "a", "status": "finished"}\nnot json\n',
                                  b'{"id": "a", "status": "finished"}\n', b'{"request_id": "a"}\n', b'[1]\n'])
def test_records_written_refuses_a_file_that_is_not_records(tmp_path, body):
    out = tmp_path / "out.jsonl"
    out.write_bytes(body)
    with pytest.raises(ResumeError, match="out.jsonl:[12]: not a record of redroll submit"):
        records_written(str(out))
    assert out.read_bytes() == body
