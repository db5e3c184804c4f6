"""The suite runs on the server named by $REDROLL_TEST_SERVER (default redis-server); CI runs the
integration tests a second time on Valkey 8. These checks make sure a run meant for one server
does not silently use the other: the session server, and servers that tests start by name
(``start_redis_server()``, as the reliability, chaos and bench tests do), are the one under test.
"""

from __future__ import annotations

import shutil
import subprocess

import redis

from redroll.testing.embedded import start_redis_server
from tests.conftest import server_executable


def _expects_valkey() -> bool:
    out = subprocess.run([server_executable(), "--version"], capture_output=True, text=True, timeout=10).stdout
    return out.startswith("Valkey")


def _is_valkey(port: int) -> bool:
    with redis.Redis(port=port) as c:
        return c.info("server").get("server_name") == "valkey"


def test_session_server_is_the_server_under_test(redis_server):
    assert _is_valkey(redis_server.port) == _expects_valkey()


def test_servers_started_by_name_are_the_server_under_test():
    server = start_redis_server()
    try:
        assert _is_valkey(server.port) == _expects_valkey()
    finally:
        server.stop()
        shutil.rmtree(server.directory, ignore_errors=True)
