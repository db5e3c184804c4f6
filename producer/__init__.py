"""Clients that submit requests and await or call back on their records."""

from producer.client import Producer, make_request, send
from producer.sync import SyncProducer
from shared.scripts import DuplicateRequestError

__all__ = ["DuplicateRequestError", "Producer", "SyncProducer", "make_request", "send"]
