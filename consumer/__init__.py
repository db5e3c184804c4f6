"""Consumer-group runner that applies request_id-keyed callbacks to result records."""

from .handlers import HandlerRegistry, load_handler
from .runner import ConsumerRunner

__all__ = ["ConsumerRunner", "HandlerRegistry", "load_handler"]
