"""The web applications: the OpenAI-compatible gateway (``redroll serve``, :mod:`.gateway`) and the
dashboard (``redroll dashboard``, :mod:`.dashboard`). Both are Starlette on uvicorn and read the
pipeline through the same APIs as every other process."""
