"""Idempotent calls: the same ``Idempotency-Key``, on any replica, gets the same completion and
generates nothing twice, for the window (``--idempotency-window``).

A keyed call is the producer's :class:`~redroll.producer.keyed.KeyedCalls` (its submit, its call
stream); this module names a call from its key and the caller, fingerprints its body, and says
its errors in HTTP.
"""

from __future__ import annotations

import hashlib

from redroll.producer.keyed import KeyedCall, KeyedCalls, KeyReusedError
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import DuplicateRequestError
from redroll.shared.types import CompletionRecord, GenerationRequest
from redroll.web.gateway.protocol import GatewayError

__all__ = ["GatewayKeyedCalls", "KeyedCall", "call_name", "fingerprint", "timed_out"]


def call_name(idempotency_key: str, scope: str) -> str:
    """The call's name from its key, scoped by who sent it (one API key's calls never meet another's)."""
    digest = hashlib.sha256(f"{scope}\0{idempotency_key}".encode()).hexdigest()[:40]
    return f"i-{digest}"


def fingerprint(raw_body: bytes) -> str:
    """What tells a retry (the same body) from a new call reusing a key."""
    return hashlib.sha256(raw_body).hexdigest()[:16]


def timed_out(timeout: float) -> GatewayError:
    return GatewayError(504, f"no record within {timeout:.0f} s; the call goes on: retry with the same "
                             "Idempotency-Key to get its completion", kind="timeout", code="timeout")


class GatewayKeyedCalls:
    """A producer's keyed calls with their errors said in HTTP: a key reused for another body
    (422), Redis refusing a request (503), a request_id held by another submit (409), no record in
    time (504)."""

    def __init__(self, calls: KeyedCalls):
        self.calls = calls
        self.wait_client = calls.wait_client

    async def run(self, requests: list[GenerationRequest], name: str, timeout: float,
                  body_fingerprint: str) -> list[CompletionRecord]:
        call = await self.start(requests, name, body_fingerprint)
        try:
            return await call.all(timeout)
        except TimeoutError:
            raise timed_out(timeout) from None
        finally:
            await call.close()

    async def start(self, requests: list[GenerationRequest], name: str, body_fingerprint: str) -> KeyedCall:
        try:
            return await self.calls.start(requests, name, body_fingerprint)
        except KeyReusedError:
            raise GatewayError(422, "this Idempotency-Key was used for a different body within the window",
                               param="Idempotency-Key", code="idempotency_key_reused") from None
        except StreamRefusedError as exc:
            raise GatewayError(503, f"Redis refused the request: {exc}", kind="server_error",
                               code="unavailable", headers={"Retry-After": "1"}) from None
        except DuplicateRequestError as exc:
            raise GatewayError(409, f"request {exc} is held by a submit that is not this gateway's",
                               code="conflict") from None
