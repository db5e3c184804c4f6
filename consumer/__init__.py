"""Consumer-group runner that applies request_id-keyed callbacks to result records."""

from redroll.consumer.handlers import HandlerRegistry, load_handler
from redroll.consumer.runner import ConsumerRunner

__all__ = ["ConsumerRunner", "HandlerRegistry", "load_handler"]
