"""The two ways a sample runs in parts share one rule for continuing and joining
(``redroll.shared.continuing``): a ``resumable`` request resumed by a worker from its checkpoint,
and a segment of ``Producer.generate_across_updates``. They differ only in seed and request_id."""

from __future__ import annotations

import pytest

from redroll.engine_worker.checkpoints import Checkpoint, resume_request
from redroll.producer import client
from redroll.producer.client import make_request
from redroll.producer.rollout import next_segment, stitch_segments
from redroll.shared.continuing import continue_after, join_parts
from redroll.shared.types import CompletionRecord, RecordStatus


def request(**sp):
    return make_request(request_id="r", input_ids=[1, 2, 3], resumable=True, meta_info={"k": 1},
                        sampling_params={"max_new_tokens": 10, "min_new_tokens": 4, **sp})


def test_continue_after_grows_the_prompt_and_shrinks_both_budgets_by_the_tokens_made():
    cont = continue_after(request(sampling_seed=9), [7, 8, 9, 10, 11])
    assert cont.input_ids == [1, 2, 3, 7, 8, 9, 10, 11]
    assert (cont.sampling_params.max_new_tokens, cont.sampling_params.min_new_tokens) == (5, 0)  # (not below 0)
    assert cont.sampling_params.sampling_seed == 9 and cont.request_id == "r"
    assert continue_after(request(), [7], seed=4, request_id="s").sampling_params.sampling_seed == 4


@pytest.mark.parametrize("seed", [9, None])
def test_a_resumed_request_and_a_segment_agree_on_prompt_and_budget_and_differ_in_seed_and_id(seed):
    made = [7, 8, 9]
    resumed = resume_request(request(sampling_seed=seed), Checkpoint(entry_id="1-0", token_ids=made))
    segment = next_segment(request(sampling_seed=seed), made, 1)
    assert resumed.input_ids == segment.input_ids == [1, 2, 3, 7, 8, 9]
    assert resumed.sampling_params.max_new_tokens == segment.sampling_params.max_new_tokens == 7
    assert resumed.sampling_params.min_new_tokens == segment.sampling_params.min_new_tokens == 1
    assert resumed.sampling_params.sampling_seed == (None if seed is None else seed + 3)  # the worker's rule
    assert segment.sampling_params.sampling_seed == seed  # the producer's rule
    assert (resumed.request_id, segment.request_id) == ("r", "r~1")
    assert next_segment(request(), list(range(10)), 2) is None  # the budget is spent


def test_join_parts_keeps_logprobs_only_when_every_part_has_them_and_versions_only_when_they_differ():
    joined = join_parts([([1, 2], [-1.0, -1.0], ["0", "0"]), ([3], [-2.0], [1])])
    assert joined.token_ids == [1, 2, 3] and joined.logprobs == [-1.0, -1.0, -2.0]
    assert joined.weight_versions == ["0", "0", "1"]
    joined = join_parts([([1], None, ["0"]), ([2], [-2.0], ["0"])])
    assert joined.logprobs is None and joined.weight_versions is None


def test_stitch_segments_joins_records_by_the_same_rule():
    def seg(rid, ids, version, reason, status=RecordStatus.FINISHED):
        return CompletionRecord(request_id=rid, status=status, output_token_ids=[ids], finish_reasons=[reason],
                                output_logprobs=[[-0.5] * len(ids)], worker="w",
                                meta_info={"weight_version": version, "prompt_tokens": 3})
    rec = stitch_segments("r", [seg("r", [7, 8], "0", "abort", RecordStatus.ABORTED), seg("r~1", [9], "1", "length")])
    assert rec.output_token_ids == [[7, 8, 9]] and rec.output_logprobs == [[-0.5] * 3]
    assert rec.weight_versions == [["0", "0", "1"]] and rec.status is RecordStatus.FINISHED
    assert [s["tokens"] for s in rec.meta_info["segments"]] == [2, 1] and rec.meta_info["completion_tokens"] == 3


async def test_the_old_name_generate_resumable_warns_once_and_runs_the_new_one(monkeypatch):
    monkeypatch.setattr(client, "_warned_renames", set())
    calls = []

    async def new(self, request=None, *, max_segments=16, **fields):
        calls.append((request, max_segments, fields))
        return "record"

    monkeypatch.setattr(client.Producer, "generate_across_updates", new)
    producer = client.Producer.__new__(client.Producer)  # (no connection: only the alias runs)
    with pytest.warns(DeprecationWarning, match="generate_resumable is renamed Producer.generate_across_updates"):
        assert await producer.generate_resumable(None, max_segments=3, input_ids=[1]) == "record"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert await producer.generate_resumable(None, input_ids=[2]) == "record"
    assert calls == [(None, 3, {"input_ids": [1]}), (None, 16, {"input_ids": [2]})]


def test_the_sync_producers_old_name_warns_and_runs_the_new_one(monkeypatch):
    from redroll.producer.sync import SyncProducer

    monkeypatch.setattr(client, "_warned_renames", set())
    monkeypatch.setattr(SyncProducer, "generate_across_updates", lambda self, request=None, **fields: ("new", fields))
    producer = SyncProducer.__new__(SyncProducer)  # (no loop thread: only the alias runs)
    with pytest.warns(DeprecationWarning, match="generate_resumable"):
        assert producer.generate_resumable(None, input_ids=[1]) == ("new", {"input_ids": [1]})
