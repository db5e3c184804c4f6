"""The stream helpers: how much the next read of a results or reply stream asks for, and group reads
as redis-py gives them (RESP3 and RESP2)."""

from __future__ import annotations

import pytest
import redis.asyncio

from redroll.shared.streams import READ_BYTES, data_size, ensure_group, read_count, read_group, script_fields


def entries(*sizes: int) -> list:
    return [(f"{i}-0", {b"data": b"x" * n, b"rid": b"r"}) for i, n in enumerate(sizes)]


def test_small_records_are_read_a_full_batch_at_a_time():
    assert read_count(entries(300, 250, 400), most=128) == 128
    assert read_count([], most=128) == 128


def test_large_records_are_read_as_many_as_make_up_the_budget():
    assert read_count(entries(400_000, 400_000), most=128) == READ_BYTES // 400_000 == 2
    assert read_count(entries(100_000, 300_000), most=128, budget=1_000_000) == 5  # (by the mean size)


def test_a_record_larger_than_the_budget_is_still_read():
    assert read_count(entries(5 * READ_BYTES), most=128) == 1


def test_entries_without_data_count_as_small():
    # deleted entries (no fields) and entries of other shapes do not shrink the reads
    assert read_count([("1-0", {}), ("2-0", None), ("3-0", {"data": "text"})], most=64) == 64
    assert data_size({b"data": b"abc"}) == data_size({"data": "abc"}) == 3
    assert data_size(None) == data_size({b"rid": b"x"}) == 0


def test_script_fields_pairs_a_flat_field_list():
    assert script_fields([b"rid", b"a", b"data", b"\x01"]) == {b"rid": b"a", b"data": b"\x01"}
    assert script_fields([]) == {}


@pytest.mark.parametrize("protocol", [3, 2])
async def test_a_group_read_gives_each_streams_entries_in_the_order_asked(settings, protocol):
    r = redis.asyncio.Redis.from_url(settings.redis_url, protocol=protocol)
    first, second = settings.keys.requests_high, settings.keys.requests
    try:
        for stream in (first, second):
            await ensure_group(r, stream, "g")
        a = (await r.xadd(second, {"rid": "a", "data": b"\x00\xff"})).decode()
        b = (await r.xadd(second, {"rid": "b"})).decode()
        c = (await r.xadd(first, {"rid": "c"})).decode()
        got = await read_group(r, "g", "c1", [first, second], count=10)
        assert got == [(first, [(c, {b"rid": b"c"})]), (second, [(a, {b"rid": b"a", b"data": b"\x00\xff"}),
                                                               (b, {b"rid": b"b"})])]
        assert await read_group(r, "g", "c1", [first, second], count=10, block=10) == []  # (nothing new)
        assert [p["message_id"].decode() for p in await r.xpending_range(second, "g", "-", "+", 10)] == [a, b]
    finally:
        await r.aclose()
