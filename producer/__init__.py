"""Clients that submit requests and await or call back on their records."""

from redroll.shared.scripts import DuplicateRequestError

from .client import BeforeAckError, Producer, make_request, send
from .sync import SyncProducer

__all__ = ["BeforeAckError", "DuplicateRequestError", "Producer", "SyncProducer", "make_request", "send"]
