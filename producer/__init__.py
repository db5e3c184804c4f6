"""Clients that submit requests and await or call back on their records."""

from redroll.producer.client import BeforeAckError, Producer, make_request, send
from redroll.producer.sync import SyncProducer
from redroll.shared.scripts import DuplicateRequestError

__all__ = ["BeforeAckError", "DuplicateRequestError", "Producer", "SyncProducer", "make_request", "send"]
