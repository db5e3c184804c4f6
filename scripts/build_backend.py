"""The build backend (pyproject.toml ``build-backend``): setuptools' own, less one note.

An editable install (``pip install -e .``) of this project maps the repository's folders
(``shared/``, ``producer/``, ...) under ``redroll.`` with an import finder, and setuptools then
says so in an informational warning ("Editable installation. Please be careful with folders in
your working directory with the same name as your package"). Recent pip prints it on every install.
It asks for nothing: the checkout's ``redroll/`` folder is meant to be the package. This backend
drops that one note and nothing else; every other warning still reaches pip.
"""

from __future__ import annotations

import warnings

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the PEP 517/660 hooks, unchanged)

_EDITABLE_NOTE = "Editable installation"


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EDITABLE_NOTE, category=UserWarning)
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
