"""Key names / hash tags and Settings precedence (defaults < environment < explicit overrides)."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from redroll.shared.codec import Limits
from redroll.shared.keys import PRODUCER_GROUP, WORKERS_GROUP, Keys
from redroll.shared.settings import Settings


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the first non-empty ``{...}``, else the whole key."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1:end]
    return key


def all_keys(k: Keys) -> list[str]:
    return [k.requests, k.results, k.dead, k.control, k.weights, k.aborted, k.workers, k.reply("p-1"),
            k.rid("3f2b6c1e-9a4d-4c6b-8f3e-2a1b0c9d8e7f_12"), k.applied("g", 17)]


# ---------------------------------------------------------------- keys


def test_key_names_single_partition():
    k = Keys("ns")
    assert k.tag == "{ns}"
    assert k.requests == "{ns}:requests"
    assert k.results == "{ns}:results"
    assert k.dead == "{ns}:dead"
    assert k.control == "{ns}:control"
    assert k.weights == "{ns}:weights"
    assert k.aborted == "{ns}:aborted"
    assert k.workers == "{ns}:workers"
    assert k.reply_prefix == "{ns}:reply:"
    assert k.reply("prod-1") == "{ns}:reply:prod-1"
    assert k.rid("abc_1") == "{ns}:rid:abc_1"
    assert k.applied("grp", 42) == "{ns}:applied:grp:42"
    assert WORKERS_GROUP == "workers"
    assert isinstance(PRODUCER_GROUP, str) and PRODUCER_GROUP


def test_default_namespace():
    assert Keys().requests == "{redroll}:requests"
    assert Settings().keys == Keys("redroll")


def test_key_names_partitioned():
    k = Keys("ns", partition=3)
    assert k.tag == "{ns:3}"
    assert k.requests == "{ns:3}:requests"
    assert k.results == "{ns:3}:results"
    assert k.dead == "{ns:3}:dead"
    assert k.reply("p") == "{ns:3}:reply:p"
    assert k.rid("r") == "{ns:3}:rid:r"
    assert Keys("ns", partition=0).tag == "{ns:0}"


@pytest.mark.parametrize("keys", [Keys("ns"), Keys("redroll"), Keys("ns", partition=0), Keys("ns", partition=3)])
def test_every_key_carries_the_tag_and_one_slot(keys):
    names = all_keys(keys)
    assert all(n.startswith(keys.tag + ":") for n in names)
    assert {hash_tag(n) for n in names} == {keys.tag[1:-1]}
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert all(n.count("{") == 1 and n.count("}") == 1 for n in names)


def test_applied_buckets_cover_window():
    k = Keys("ns")
    assert k.applied_buckets("g", 100, now=1050.0) == ["{ns}:applied:g:10", "{ns}:applied:g:9"]
    assert k.applied_buckets("g", 100, now=1000.0) == ["{ns}:applied:g:10", "{ns}:applied:g:9"]


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "a:b", "a b", "tab\t", "nl\n"])
def test_bad_namespace_refused(bad):
    with pytest.raises(ValueError):
        Keys(bad)


def test_is_reply_key_accepts_own_streams():
    k = Keys("ns")
    assert k.is_reply_key("{ns}:results")
    assert k.is_reply_key("{ns}:reply:producer-host-12-abc123")
    assert k.is_reply_key(k.reply("x"))
    assert k.is_reply_key("{ns}:reply:" + "x" * 128)
    assert k.is_reply_key("{ns}:reply:a:b~|!")
    p = Keys("ns", partition=2)
    assert p.is_reply_key("{ns:2}:results")
    assert p.is_reply_key("{ns:2}:reply:p")


@pytest.mark.parametrize(
    "key",
    [
        "{other}:results",
        "{other}:reply:p",
        "{ns2}:results",
        "{ns}:requests",
        "{ns}:dead",
        "{ns}:control",
        "{ns}:workers",
        "{ns}:weights",
        "{ns}:aborted",
        "{ns}:rid:x",
        "{ns}:reply:",
        "{ns}:reply:" + "x" * 129,
        "{ns}:reply:has space",
        "{ns}:reply:brace{x}",
        "{ns}:reply:}",
        "{ns}:reply:nl\n",
        "{ns}:reply:é",
        "{ns}:results:extra",
        "{ns}:resultsx",
        "ns:results",
        "other:stream",
        "",
        "{ns:3}:results",
        "{ns:3}:reply:p",
    ],
)
def test_is_reply_key_refuses_others(key):
    assert not Keys("ns").is_reply_key(key)


def test_partitions_refuse_each_other():
    assert not Keys("ns", partition=1).is_reply_key("{ns:2}:results")
    assert not Keys("ns", partition=1).is_reply_key("{ns}:results")
    assert not Keys("ns", partition=1).is_reply_key("{ns}:reply:p")


# ---------------------------------------------------------------- settings


def test_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert s.namespace == "redroll"
    assert s.redis_url == "redis://localhost:6379/0"
    assert s.redis_password is None


def test_env_over_defaults_with_types():
    env = {
        "REDROLL_NAMESPACE": "fromenv",
        "REDROLL_REDIS_URL": "redis://h:1/2",
        "REDROLL_CLAIM_IDLE_MS": "1234",
        "REDROLL_HEARTBEAT_S": "0.25",
        "REDROLL_MAX_DELIVERIES": "9",
        "REDROLL_REDIS_PASSWORD": "s3cret",
        "REDROLL_MAX_PAYLOAD_BYTES": "2048",
        "UNRELATED": "x",
        "REDROLL_NOT_A_SETTING": "ignored",
    }
    s = Settings.from_env(env)
    assert s.namespace == "fromenv"
    assert s.redis_url == "redis://h:1/2"
    assert s.claim_idle_ms == 1234 and isinstance(s.claim_idle_ms, int)
    assert s.heartbeat_s == 0.25 and isinstance(s.heartbeat_s, float)
    assert s.max_deliveries == 9
    assert s.redis_password == "s3cret"
    assert s.keys == Keys("fromenv")
    assert s.limits == Limits(max_payload_bytes=2048, max_new_tokens=s.max_new_tokens, max_n=s.max_n)
    assert s.drain_timeout_s == Settings().drain_timeout_s  # untouched values keep their defaults


@pytest.mark.parametrize("name, value", [
    ("rid_ttl_s", 0), ("reply_ttl_s", -1), ("dedup_window_s", 0), ("claim_idle_ms", 0), ("max_deliveries", 0),
    ("heartbeat_s", 0.0), ("heartbeat_s", float("nan")), ("partitions", 0), ("affinity_lanes", -1),
    ("checkpoint_tokens", 0), ("gc_interval_s", -1.0), ("max_n", 0),
])
def test_a_setting_out_of_its_range_is_refused_naming_it(name, value):
    # (an expiry of 0 made the submit script fail after its XADD, a checkpoint vanish as it was written)
    with pytest.raises(ValueError) as err:
        Settings(**{name: value})
    assert str(err.value).startswith(f"{name} (REDROLL_{name.upper()}) must be at least ")
    with pytest.raises(ValueError):
        Settings.from_env({f"REDROLL_{name.upper()}": str(value)})
    with pytest.raises(ValueError):
        Settings().with_(**{name: value})
    assert Settings(results_max_len=0).results_max_len == 0  # (0 or less: no cap)


def test_empty_env_value_means_unset():
    s = Settings.from_env({"REDROLL_NAMESPACE": "", "REDROLL_CLAIM_IDLE_MS": ""})
    assert s.namespace == "redroll" and s.claim_idle_ms == Settings().claim_idle_ms


def test_overrides_beat_env_and_none_overrides_are_ignored():
    env = {"REDROLL_NAMESPACE": "fromenv", "REDROLL_CLAIM_IDLE_MS": "1234", "REDROLL_REDIS_URL": "redis://e:1/0"}
    s = Settings.from_env(env, namespace="fromflag", claim_idle_ms=99, redis_url=None)
    assert s.namespace == "fromflag"
    assert s.claim_idle_ms == 99
    assert s.redis_url == "redis://e:1/0"  # a flag left unset (None) does not erase the env value
    s2 = Settings.from_env({}, max_deliveries=7)
    assert s2.max_deliveries == 7 and s2.namespace == "redroll"


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("REDROLL_NAMESPACE", "osenv")
    monkeypatch.setenv("REDROLL_RESULTS_MAX_LEN", "77")
    s = Settings.from_env()
    assert s.namespace == "osenv" and s.results_max_len == 77
    assert Settings.from_env(namespace="flag").namespace == "flag"


@pytest.mark.parametrize(
    "var, raw",
    [
        ("REDROLL_CLAIM_IDLE_MS", "soon"),
        ("REDROLL_MAX_DELIVERIES", "1.5"),
        ("REDROLL_HEARTBEAT_S", "fast"),
        ("REDROLL_DRAIN_TIMEOUT_S", "30s"),
        ("REDROLL_MAX_PAYLOAD_BYTES", "4MB"),
    ],
)
def test_bad_env_value_names_the_variable(var, raw):
    with pytest.raises(ValueError) as ei:
        Settings.from_env({var: raw})
    assert var in str(ei.value)
    assert raw in str(ei.value)


def test_bad_namespace_from_env_is_refused_when_keys_are_built():
    s = Settings.from_env({"REDROLL_NAMESPACE": "bad{ns}"})
    with pytest.raises(ValueError):
        s.keys


def test_with_returns_a_changed_copy():
    s = Settings(namespace="a")
    t = s.with_(namespace="b", max_payload_bytes=4096)
    assert s.namespace == "a" and t.namespace == "b"
    assert t.limits.max_payload_bytes == 4096
    assert s.limits.max_payload_bytes == Settings().max_payload_bytes
