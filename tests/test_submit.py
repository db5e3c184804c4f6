"""``redroll submit`` as a module: what reaches the output file, and what a refused submit does."""

from __future__ import annotations

import asyncio
import io
import json
import re

import msgspec
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from redroll.cli.batch_run import (
    ACCEPTED_FIELDS,
    InputError,
    _progress,
    read_requests,
    request_from_line,
    request_from_plain_values,
    submit_file,
)
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.shared.codec import Limits
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, SamplingParams
from tests.conftest import running


async def test_every_record_is_written_as_one_json_line(settings, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"request_id": f"j{i}", "input_ids": [i + 1, 2], "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 3}}) + "\n" for i in range(300)))
    async with running(Worker(settings, SyntheticEngine(), max_inflight=64)):
        code = await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=60)
    assert code == 0
    lines = out.read_bytes().splitlines()
    assert len(lines) == 300
    records = [msgspec.json.decode(line, type=CompletionRecord) for line in lines]  # the record, field for field
    assert sorted(r.request_id for r in records) == sorted(f"j{i}" for i in range(300))
    assert all(r.ok and len(r.output_token_ids[0]) == 3 == len(r.output_logprobs[0]) for r in records)


async def test_a_request_refused_at_submit_is_reported_and_the_others_still_written(settings, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"request_id": rid, "prompt": "x"}) + "\n" for rid in ("a", "held", "b")))
    async with Producer(settings) as other:
        # live for the whole test: the worker parks it until weights it does not have
        await other.submit(request_id="held", prompt="y", min_weight_version=99)
        async with running(Worker(settings, SyntheticEngine(), max_inflight=8)):
            code = await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=30)
    assert code == 3
    assert sorted(json.loads(x)["request_id"] for x in out.read_text().splitlines()) == ["a", "b"]
    err = capsys.readouterr().err
    assert "held: not submitted" in err and "1 of 3 request(s) did not finish" in err


async def test_a_file_of_one_refused_request_exits_3(settings, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"request_id": "held", "prompt": "x"}) + "\n")
    async with Producer(settings) as other:
        await other.submit(request_id="held", prompt="y")  # no worker: it stays live
        code = await submit_file(settings, str(src), wait=True, out=str(tmp_path / "out.jsonl"), progress=False,
                                 timeout=10)
    assert code == 3 and (tmp_path / "out.jsonl").read_text() == ""
    assert "held: not submitted" in capsys.readouterr().err


async def test_without_wait_a_refused_request_is_named_and_the_others_queued(settings, r, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"request_id": rid, "prompt": "x"}) + "\n" for rid in ("a", "held", "b")))
    async with Producer(settings) as other:
        await other.submit(request_id="held", prompt="y")  # no worker: it stays live
        code = await submit_file(settings, str(src), wait=False, out=None, progress=False)
    assert code == 3
    out, err = capsys.readouterr()
    assert "held: not submitted: request_id 'held' is already queued" in err
    assert f"submitted 2 of 3 request(s) to {settings.keys.requests}; records go to {settings.keys.results}" in out
    assert sorted(f[b"rid"] for _i, f in await r.xrange(settings.keys.requests)) == [b"a", b"b", b"held"]


async def test_without_wait_the_streams_named_are_the_ones_used(settings, r, tmp_path, capsys):
    s = settings.with_(partitions=3)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"request_id": f"p{i}", "prompt": "x", "priority": i % 2}) + "\n"
                           for i in range(12)))
    assert await submit_file(s, str(src), wait=False, out=None, progress=False) == 0
    used = [k for k in await r.keys(f"{{{s.namespace}:*}}:requests*") if await r.xlen(k)]
    said = capsys.readouterr().out
    assert said.startswith("submitted 12 of 12 request(s) to ") and len(used) >= 3
    assert set(said.split(" to ", 1)[1].split("; ")[0].split(", ")) == {k.decode() for k in used}
    assert f"{{{s.namespace}:0}}:results" in said  # (the results streams of the partitions used)


async def test_a_timeout_says_how_many_records_did_not_come(settings, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"request_id": f"t{i}", "prompt": "x"}) + "\n" for i in range(3)))
    code = await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=0.5)  # (no worker)
    assert code == 3 and out.read_text() == ""
    err = capsys.readouterr().err
    assert "timed out after 0.5 s: 3 of 3 record(s) not received" in err
    assert "3 of 3 request(s) did not finish" in err


def _read(*lines: str):
    return read_requests([line + "\n" for line in lines], Settings(), source="in.jsonl")


def test_read_requests_takes_valid_lines_and_skips_blank_ones():
    reqs = _read(json.dumps({"request_id": "a", "prompt": "x", "sampling_params": {"max_new_tokens": 3}}), "  ",
                 json.dumps({"prompt": "y", "meta_info": {"k": [1, 2.5, None]}}))
    assert [r.prompt for r in reqs] == ["x", "y"] and reqs[0].request_id == "a"
    assert reqs[0].sampling_params.max_new_tokens == 3 and reqs[1].meta_info == {"k": [1, 2.5, None]}
    assert len(reqs[1].request_id) == 32  # named when the line names none


@pytest.mark.parametrize("line, reason", [
    ('{"request_id": "a", "prompt": "x"', "not valid JSON"),
    ('{"request_id": "a", "prompt": "x"} trailing', "not valid JSON"),
    # json.dumps writes these, but they are not JSON: refused with the line, never sent
    (json.dumps({"request_id": "a", "prompt": "x", "meta_info": {"score": float("nan")}}), "not valid JSON"),
    (json.dumps({"request_id": "a", "prompt": "\ud800"}), "not valid JSON"),
    ('["a", "x"]', "each line must be a JSON object"),
    ('{"request_id": "a", "prompt": "x", "promt": 1}', "unknown field(s) promt"),
    ('{"request_id": "a", "prompt": "x", "sampling_params": {"temperature": -1}}', "temperature"),
    # poison lines: a clear reason, never a traceback
    ('{"request_id": "a", "prompt": "x", "meta_info": {"k": ' + "[" * 5000 + "]" * 5000 + "}}",
     "invalid data: maps or lists nested too deeply"),
    ('{"prompt": "x", "meta_info": {"k": ' + "[" * 5000 + "]" * 5000 + "}}", "nested too deeply"),
    ('{"request_id": "a", "prompt": "x", "meta_info": {"k": 18446744073709551616}}', "64-bit range"),
    ('{"request_id": "a", "prompt": "x", "sampling_params": {"custom_params": {"k": -9223372036854775809}}}',
     "64-bit range"),
    # an empty or non-string request_id is refused, not replaced (only a missing or null one is named)
    ('{"request_id": "", "prompt": "x"}', "invalid request_id"),
    ('{"request_id": 0, "prompt": "x"}', "invalid request_id"),
    ('{"request_id": false, "prompt": "x"}', "invalid request_id"),
])
def test_read_requests_names_the_line_and_the_reason(line, reason):
    with pytest.raises(InputError) as err:
        _read(json.dumps({"request_id": "ok", "prompt": "x"}), line)
    assert str(err.value).startswith("in.jsonl:2: ") and reason in str(err.value)


def test_read_requests_refuses_a_request_id_twice():
    with pytest.raises(InputError, match="in.jsonl:3: request_id 'a' appears twice"):
        _read(*(json.dumps({"request_id": rid, "prompt": "x"}) for rid in ("a", "b", "a")))


def test_the_usual_line_is_decoded_straight_into_the_request(monkeypatch):
    def plain_values(line, limits):
        raise AssertionError(f"took the plain values' path: {line}")

    monkeypatch.setattr("redroll.cli.batch_run.request_from_plain_values", plain_values)
    line = json.dumps({"request_id": "a", "input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 2,
                       "sampling_params": {"max_new_tokens": 3, "stop": ["x"], "sampling_seed": None},
                       "meta_info": {"k": [1, None]}, "callback": "h", "group_id": "g", "priority": 1,
                       "deadline": 2e9, "resumable": True, "prompt": None})
    req = request_from_line(line, Settings().limits)
    assert (req.request_id, req.input_ids, req.top_logprobs_num, req.priority) == ("a", [5, 6], 2, 1)
    assert req.sampling_params.stop == ("x",) and req.meta_info == {"k": [1, None]}
    assert (req.v, req.submitted_at) == (0, None)  # (stamped at the submit, as for any request)
    with pytest.raises(InputError, match="invalid sampling_params.max_new_tokens"):
        request_from_line('{"request_id": "a", "prompt": "x", "sampling_params": {"max_new_tokens": 10000000}}',
                          Settings().limits)


_json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**65), max_value=2**65)
                 | st.floats(allow_nan=False) | st.text(max_size=12) | st.sampled_from(["a", "x", "", "k-1"]))
_json_values = st.recursive(
    _json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_line_keys = st.sampled_from(sorted(ACCEPTED_FIELDS) + ["v", "reply_to", "submitted_at", "requeued", "promt"])
_sampling_keys = st.sampled_from(sorted(SamplingParams.__struct_fields__) + ["unknown"])
_good = {"prompt": "hi", "return_logprob": True, "collect_unfinished": True, "meta_info": {"k": [1, 2.5, None]},
         "callback": "h", "group_id": "g", "affinity_key": "s", "deadline": 2e9, "lora_path": "l", "model": "m",
         "priority": 1, "min_weight_version": 3, "top_logprobs_num": 2, "logprob_start_len": 1,
         "return_routed_experts": True, "resumable": True}


@st.composite
def _lines(draw):
    line: dict = {"request_id": "r1", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    for key in draw(st.lists(st.sampled_from(sorted(_good)), max_size=6)):
        line[key] = _good[key]
    for key, value in draw(st.dictionaries(_line_keys, _json_values, max_size=3)).items():
        line[key] = value
    if draw(st.booleans()):
        line["sampling_params"] = draw(st.dictionaries(_sampling_keys, _json_values, max_size=3))
    for key in draw(st.lists(_line_keys, max_size=2)):
        line.pop(key, None)
    return json.dumps(line, allow_nan=True)


def _outcome(read, line: str, limits: Limits):
    try:
        req = read(line, limits)
    except InputError as exc:
        return str(exc)
    if not json.loads(line).get("request_id"):
        assert len(req.request_id) == 32  # (named by uuid4 on either path)
        req = msgspec.structs.replace(req, request_id="named")
    return msgspec.json.encode(req)


@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(line=_lines())
def test_property_both_paths_read_a_line_alike(line):
    # the typed decode takes a line only where the plain values' path reads the same request;
    # every other line gets that path's reason
    for limits in (Settings().limits, Limits(max_payload_bytes=300, max_meta_bytes=16, max_input_tokens=2,
                                             max_new_tokens=100, max_n=4)):
        assert _outcome(request_from_line, line, limits) == _outcome(request_from_plain_values, line, limits)


async def test_progress_off_a_terminal_is_plain_lines_with_a_last_one(settings, tmp_path, capsys):
    """stderr that is not a terminal (capsys: a log file, a pipe) gets plain lines, the last one
    with every record counted, and no terminal codes."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"request_id": f"p{i}", "input_ids": [i + 1]}) + "\n" for i in range(40)))
    async with running(Worker(settings, SyntheticEngine(), max_inflight=16)):
        code = await submit_file(settings, str(src), wait=True, out=str(out), progress=True, timeout=30)
    assert code == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err
    assert re.fullmatch(r"records 40/40 [\d,.]+/s elapsed \d+\.\d s", err.strip().splitlines()[-1])


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


async def test_plain_progress_writes_a_line_each_interval_and_at_close():
    stream = _Stream(tty=False)
    bar = _progress(10, stream=stream, every_s=0.05)
    bar.advance(3)  # before the first interval: nothing yet
    assert stream.getvalue() == ""
    await asyncio.sleep(0.06)
    bar.advance(2)
    bar.advance(1)  # (the next line is an interval away)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["5/10", "6/10"]


async def test_progress_on_a_terminal_is_a_rich_bar():
    stream = _Stream(tty=True)
    bar = _progress(4, stream=stream)
    assert bar._p is not None  # rich's live bar, drawn on the terminal
    bar.advance(4)
    bar.close()
    assert "4/4" in stream.getvalue()


async def test_no_progress_writes_nothing():
    stream = _Stream(tty=False)
    bar = _progress(4, enabled=False, stream=stream)
    bar.advance(4)
    bar.close()
    assert stream.getvalue() == ""
