"""``redroll repair`` on the server under test (redis-server here, valkey-server in CI's second run).

Redis 7.0 lets XSETID go below the largest deleted id and is repaired in place; Valkey 8 refuses
that and the stream is rebuilt. Either way the repaired stream must hold the same entries, groups,
consumers and pending entries, and take new entries again.
"""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from redroll.ops.repair import PROBE_SUFFIX, repair_stream

LAST_ID = "18446744073709551615-18446744073709551615"


async def expected_method(r) -> str:
    info = await r.info("server")
    if "valkey_version" in info:
        return "rebuilt"
    return "xsetid" if str(info["redis_version"]).startswith("7.0.") else "either"


async def trapped_stream(r, key: str) -> None:
    """Five entries, a group that read three (two still pending, one delivered twice), a consumer
    with nothing pending, an idle group, then the trap entry, read by the first group too."""
    for i in range(1, 6):
        await r.xadd(key, {"n": str(i), "payload": f"p{i}"}, id=f"{i}-0")
    await r.xgroup_create(key, "g", id="0")
    await r.xgroup_create(key, "idle", id="0")
    await r.xreadgroup("g", "alice", {key: ">"}, count=3)
    await r.xack(key, "g", "1-0")
    await r.xclaim(key, "g", "bob", 0, ["3-0"])
    await r.xgroup_createconsumer(key, "g", "carol")
    await r.xadd(key, {"f": "v"}, id=LAST_ID)
    await r.xreadgroup("g", "alice", {key: ">"}, count=10)  # 4-0, 5-0 and the trap


async def pending(r, key: str, group: str) -> list[tuple[str, str, int]]:
    rows = await r.xpending_range(key, group, "-", "+", 100)
    return [(x["message_id"].decode(), x["consumer"].decode(), x["times_delivered"]) for x in rows]


async def test_repair_keeps_entries_groups_and_pending_entries(r, namespace):
    key = f"{{{namespace}}}:results"
    await trapped_stream(r, key)
    with pytest.raises(ResponseError, match="exhausted the last possible ID"):
        await r.xadd(key, {"x": "y"})
    before_pending = [p for p in await pending(r, key, "g") if p[0] != LAST_ID]

    assert (await repair_stream(r, key, dry_run=True)).state == "broken"
    report = await repair_stream(r, key)
    assert report.state == "repaired" and report.removed == [LAST_ID]
    assert report.method == await expected_method(r) or await expected_method(r) == "either"
    assert report.new_last_id == "5-0" and report.groups_reset == ["g"]
    assert not await r.exists(key + PROBE_SUFFIX)

    entries = await r.xrange(key)
    assert [e[0].decode() for e in entries] == [f"{i}-0" for i in range(1, 6)]
    assert entries[1][1] == {b"n": b"2", b"payload": b"p2"}
    assert await pending(r, key, "g") == before_pending
    groups = {g["name"].decode(): g for g in await r.xinfo_groups(key)}
    assert groups["g"]["last-delivered-id"] == b"5-0" and groups["idle"]["last-delivered-id"] == b"0-0"
    consumers = {c["name"].decode() for c in await r.xinfo_consumers(key, "g")}
    assert consumers == {"alice", "bob", "carol"}
    # It takes entries again, and the group sees exactly the new one.
    new_id = await r.xadd(key, {"after": "repair"})
    assert (await r.xreadgroup("g", "alice", {key: ">"}))[0][1][0][0] == new_id
    assert (await repair_stream(r, key)).state == "ok"


async def test_repair_of_an_empty_trapped_stream(r, namespace):
    key = f"{{{namespace}}}:reply:x"
    await r.xadd(key, {"f": "v"}, id=LAST_ID)
    await r.xdel(key, LAST_ID)
    report = await repair_stream(r, key)
    assert report.state == "repaired" and report.removed == [] and report.new_last_id == "0-1"
    assert await r.xlen(key) == 0
    assert await r.xadd(key, {"a": "b"})


async def test_a_rebuild_longer_than_the_limit_changes_nothing(r, namespace):
    key = f"{{{namespace}}}:requests"
    await trapped_stream(r, key)
    report = await repair_stream(r, key, max_rebuild=2)
    if report.method == "xsetid":  # this server repairs in place: no rebuild, no limit
        assert await expected_method(r) != "rebuilt"
        return
    assert report.state == "toolarge" and report.length == 5
    assert (await r.xinfo_stream(key))["last-generated-id"] == LAST_ID.encode()
    assert await r.xlen(key) == 6 and not await r.exists(key + PROBE_SUFFIX)


async def test_other_states(r, namespace):
    assert (await repair_stream(r, f"{{{namespace}}}:nothing")).state == "none"
    await r.hset(f"{{{namespace}}}:hash", "a", "b")
    report = await repair_stream(r, f"{{{namespace}}}:hash")
    assert report.state == "wrongtype" and report.kind == "hash"
