"""One error family: ``except redroll.RedrollError`` catches every error redroll raises on purpose."""

from __future__ import annotations

import re
import socket
import time

import pytest

import redroll
import redroll.errors
from redroll import Producer, RedrollError
from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines import create_engine
from redroll.engine_worker.worker import Worker
from redroll.shared.settings import Settings


def _documented() -> list[str]:
    return re.findall(r"^``(\w+)`` +``", redroll.errors.__doc__, re.M)


def test_every_documented_error_is_exported_and_in_the_family():
    documented = _documented()
    assert len(documented) >= 16
    assert set(documented) == set(redroll.errors.__all__)
    for name in documented:
        cls = getattr(redroll, name)
        assert cls is getattr(redroll.errors, name)
        assert name in redroll.__all__
        assert issubclass(cls, RedrollError), name
        # each is caught by except RedrollError (and keeps its former base)
        try:
            raise cls.__new__(cls)
        except RedrollError:
            pass


@pytest.mark.parametrize("name, base", [
    ("ValidationError", ValueError), ("InputError", ValueError), ("ResumeError", ValueError),
    ("RequeueRefused", ValueError), ("WeightsRefused", ValueError), ("DuplicateRequestError", RuntimeError),
    ("LanesMismatchError", RuntimeError), ("BeforeAckError", RuntimeError), ("WeightSyncError", RuntimeError),
    ("EngineRequestError", RuntimeError), ("RedisConfigError", RuntimeError),
    ("ConnectionUnavailableError", ConnectionError),
])
def test_errors_keep_their_former_bases(name, base):
    assert issubclass(getattr(redroll, name), base)


def test_stream_refused_is_still_a_redis_response_error():
    import redis

    assert issubclass(redroll.StreamRefusedError, redis.ResponseError)


def test_a_validation_error_is_caught_as_a_redroll_error():
    from redroll.shared.codec import request_from_values

    with pytest.raises(RedrollError):
        request_from_values({"request_id": "a b", "prompt": "x"})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unreachable() -> tuple[Settings, str]:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    return Settings(redis_url=url, namespace="errors-test"), url


async def test_a_producer_on_a_closed_port_raises_a_redroll_error_naming_the_url():
    settings, url = _unreachable()
    start = time.monotonic()
    with pytest.raises(redroll.ConnectionUnavailableError) as caught:
        async with Producer(settings):
            pass
    assert url in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.__cause__ is not None
    assert isinstance(caught.value, ConnectionError) and isinstance(caught.value, RedrollError)
    assert time.monotonic() - start < 60


async def test_a_worker_and_a_consumer_on_a_closed_port_raise_it_too():
    settings, url = _unreachable()
    with pytest.raises(RedrollError, match=re.escape(url)):
        await Worker(settings, create_engine("synthetic")).run()
    with pytest.raises(RedrollError, match=re.escape(url)):
        await ConsumerRunner(settings, group="g", default_handler=lambda record: None).run()
