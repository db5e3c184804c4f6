"""``redroll dashboard``: the pipeline on one live web page (the ``dashboard`` extra)."""
