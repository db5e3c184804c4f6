"""``--burst`` for ``redroll worker`` and ``redroll consume``: run until there is nothing left to do,
then drain and exit 0 (for batch jobs, CI and tests)."""

from __future__ import annotations

import argparse

_HELP = {
    "worker": "exit (0) once nothing is queued or claimed in the request streams of the worker's partitions "
              "and it holds nothing; entries a dead worker held are reclaimed first",
    "consume": "exit (0) once nothing is left for the group (records it has no handler for aside) and, on the "
               "results streams, no request is queued or claimed: no record is still to come",
}


def add_burst_flag(parser: argparse.ArgumentParser, command: str) -> None:
    """Add ``--burst`` to the parser of ``command`` (``worker`` or ``consume``)."""
    parser.add_argument("--burst", action="store_true", help=_HELP[command])
