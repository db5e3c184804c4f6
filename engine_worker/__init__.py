"""Engine workers: claim requests from ``{ns}:requests``, generate, publish fenced records."""
