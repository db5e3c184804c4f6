"""Clients that submit requests and await or call back on their records."""

from redroll.shared.scripts import DuplicateRequestError

from .client import Producer, make_request, send
from .sync import SyncProducer

__all__ = ["DuplicateRequestError", "Producer", "SyncProducer", "make_request", "send"]
