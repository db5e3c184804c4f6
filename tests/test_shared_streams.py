"""The stream helpers' pure parts: how much the next read of a results or reply stream asks for."""

from __future__ import annotations

from redroll.shared.streams import READ_BYTES, data_size, read_count, script_fields


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
