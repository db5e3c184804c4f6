"""``redroll serve``: an OpenAI-compatible HTTP gateway over the pipeline (needs the ``serve`` extra)."""
