"""The README as a newcomer reads it: short, its links resolve, it names no file outside the
project, it points to what users have (gateway, dashboard, chats, Sentinel, redroll.testing), and
its two commands put redroll in one place, the checkout's .venv, whatever python3 is."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def _check_readme_links():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_readme_links
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return check_readme_links


def test_the_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 200
    assert _check_readme_links().check(ROOT / "README.md") == []


def test_the_readme_names_no_file_outside_the_project():
    # An absolute path (/tmp/x, /models/x, /home/...), outside URLs; /path/to/ is a placeholder.
    text = re.sub(r"[a-z+]+://\S+", "", README)
    absolute = [m.group(0) for m in re.finditer(r"(?<![\w.~-])/[A-Za-z][\w.-]*(?:/[\w.-]+)*", text)
                if not m.group(0).startswith("/path/to/")]
    assert absolute == []
    assert "../" not in text


@pytest.mark.parametrize("page", ["docs/gateway.md", "docs/dashboard.md", "docs/testing.md",
                                  "docs/cluster.md#high-availability-with-redis-sentinel",
                                  "docs/design.md#text-in-and-out", "docs/getting-started.md"])
def test_the_readme_points_into_the_docs(page):
    assert f"]({page})" in README


def _source_python_env(checkout: Path, env: dict) -> str:
    proc = subprocess.run(["bash", "-c", '. .ci/python-env && echo "PY=$PY"'], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1].removeprefix("PY=")


@pytest.mark.slow
def test_the_demo_and_the_tests_install_into_the_checkouts_venv_whatever_python3_is(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "python-env", checkout / ".ci" / "python-env")
    # Inside an activated virtualenv (this test's own interpreter may be one): still the checkout's .venv.
    env = {**os.environ, "PYTHON": sys.executable, "VIRTUAL_ENV": sys.prefix}
    py = _source_python_env(checkout, env)
    assert py == str(checkout / ".venv" / "bin" / "python")
    assert subprocess.run([py, "-c", "import sys; assert sys.prefix != sys.base_prefix"], timeout=60).returncode == 0
    made = (checkout / ".venv" / "pyvenv.cfg").stat().st_mtime_ns
    # Once made, it is used as it is, whichever PYTHON is asked for.
    env["PYTHON"] = "python3-that-does-not-exist"
    assert _source_python_env(checkout, env) == py
    assert (checkout / ".venv" / "pyvenv.cfg").stat().st_mtime_ns == made
