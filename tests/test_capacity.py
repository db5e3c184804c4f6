"""The capacity model (redroll.ops.capacity) and ``redroll capacity``: its arithmetic on given
constants, the shard formula, flags and errors. No measurement here: the constants come from the
benchmarks (docs/capacity.md)."""

from __future__ import annotations

import json

import pytest

from redroll.cli.main import main
from redroll.ops.capacity import CONSTANTS, Workload, constants, estimate, redis_share, tokens_per_chunk

GIVEN = dict(request_us=100.0, chunk_us=50.0, chunk_call_us=30.0, checkpoint_us=40.0, idle_worker_us=20.0,
             chunk_timer_extra_ms=0.0)


def test_every_constant_says_where_it_came_from():
    for name, c in CONSTANTS.items():
        assert c.value >= 0 and c.unit and "benchmarks" in c.source, name


def test_plain_requests_cost_their_rate_times_the_request_constant():
    e = estimate(Workload(tokens_per_s=5000, completion_tokens=500, continuation=False), share_of_core=1.0, **GIVEN)
    assert e.requests_per_s == 10.0 and e.chunks_per_s == 0.0
    assert e.per_gpu_us == {"requests": 1000.0, "stream_chunks": 0.0, "checkpoints": 0.0, "idle_workers": 20.0}
    assert e.gpus == pytest.approx(1e6 / 1020.0)


def test_a_stream_sends_a_chunk_every_k_tokens_by_the_8_token_rule_or_the_timer():
    fast = Workload(tokens_per_s=64_000, completion_tokens=500, concurrency=64, stream=True)  # 1,000 tokens/s each
    slow = Workload(tokens_per_s=2_000, completion_tokens=500, concurrency=64, stream=True)  # 31.25 tokens/s each
    assert tokens_per_chunk(fast) == 8.0  # (50 ms would hold 50 tokens: the 8-token rule comes first)
    assert tokens_per_chunk(slow) == pytest.approx(31.25 * 0.05)
    assert tokens_per_chunk(slow, extra_ms=30) == pytest.approx(31.25 * 0.08)
    assert tokens_per_chunk(Workload(tokens_per_s=100, completion_tokens=10, concurrency=64, stream=True)) == 1.0
    e = estimate(slow, share_of_core=1.0, **GIVEN)
    assert e.chunks_per_s == pytest.approx(2000 / (31.25 * 0.05))
    # (the 64 streams' timers beat together: one write each 50 ms for all their chunks)
    assert e.chunk_writes_per_s == pytest.approx(20.0)
    assert e.per_gpu_us["stream_chunks"] == pytest.approx(e.chunks_per_s * 50.0 + 20.0 * 30.0)
    # a fast stream's chunks are due at every look (20 ms), never more writes than chunks
    assert estimate(fast, **GIVEN).chunk_writes_per_s == pytest.approx(50.0)
    one = Workload(tokens_per_s=10, completion_tokens=100, concurrency=1, stream=True)
    assert estimate(one, **GIVEN).chunk_writes_per_s == pytest.approx(10 / tokens_per_chunk(one))


def test_checkpoints_count_only_for_requests_that_continue_and_are_not_streamed():
    long = Workload(tokens_per_s=2560, completion_tokens=4096, concurrency=10,
                    checkpoint_tokens=256, checkpoint_interval_s=1.0, checkpoint_min_new_tokens=1024)
    # each stream makes 256 tokens a second: a save a second, 16 s a request, the last part goes with the finish
    assert estimate(long, **GIVEN).checkpoints_per_s == pytest.approx(15 * 2560 / 4096)
    assert estimate(Workload(tokens_per_s=2560, completion_tokens=500, checkpoint_min_new_tokens=1024),
                    **GIVEN).checkpoints_per_s == 0
    assert estimate(Workload(tokens_per_s=2560, completion_tokens=4096, stream=True), **GIVEN).checkpoints_per_s == 0
    assert estimate(Workload(tokens_per_s=2560, completion_tokens=4096, continuation=False),
                    **GIVEN).checkpoints_per_s == 0
    # (the defaults: every request continues, saved every 32 tokens and 2 s, whichever later)
    default = estimate(Workload(tokens_per_s=2560, completion_tokens=4096, concurrency=10), **GIVEN)
    assert default.checkpoints_per_s == pytest.approx((16 / 2 - 1) * 2560 / 4096)


def test_shards_divide_the_per_request_work_but_not_the_heartbeats():
    w = Workload(tokens_per_s=1000, completion_tokens=100, continuation=False)
    e = estimate(w, share_of_core=0.5, shards=(1, 4), **GIVEN)
    variable, fixed = 10 * 100.0, 20.0
    assert e.shards[1] == pytest.approx(0.5e6 / (variable + fixed)) == pytest.approx(e.gpus)
    assert e.shards[4] == pytest.approx(0.5e6 / (variable / 4 + fixed))
    assert redis_share(w, 100, **GIVEN) == pytest.approx(100 * (variable + fixed) / 1e6)


def test_bad_inputs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="completion_tokens"):
        Workload(tokens_per_s=10, completion_tokens=0)
    with pytest.raises(ValueError, match="share_of_core"):
        estimate(Workload(tokens_per_s=10, completion_tokens=10), share_of_core=1.5)
    with pytest.raises(KeyError):
        constants(no_such_constant=1.0)


def test_the_command_prints_the_derivation_and_json(capsys):
    assert main(["capacity", "--tokens-per-s", "5000", "--completion-tokens", "500", "--stream", "--gpus", "1000",
                 "--chunk-us", "10", "--show-constants"]) == 0
    out = capsys.readouterr().out
    assert "R = T / L = 5,000 / 500 = 10.00" in out and "K x 10 µs" in out and "S = 8:" in out
    assert "chunk_us = 10 (given)" in out and "from: python -m benchmarks" in out
    assert main(["capacity", "--tokens-per-s", "5000", "--completion-tokens", "500", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests_per_s_per_gpu"] == 10.0 and doc["gpus_per_primary"] > 0
    with pytest.raises(SystemExit) as exit_:
        main(["capacity", "--tokens-per-s", "0", "--completion-tokens", "500"])
    assert exit_.value.code == 2 and "--tokens-per-s: must be > 0" in capsys.readouterr().err
