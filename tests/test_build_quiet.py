"""Installing redroll prints no setuptools warning (an editable install used to print about 40
lines: ``Package 'redroll.shared.lua' is absent from the packages configuration``, and with a
current pip setuptools' "Editable installation" note, which scripts/build_backend.py drops), and
the wheel carries the Lua scripts."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_an_editable_install_prints_no_build_warning(tmp_path):
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    # The pip scripts/demo.sh and .ci/run use: a current one, which prints the build backend's warnings.
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                   capture_output=True, text=True, timeout=300)
    relays = subprocess.run([str(python), "-c", "from pip._vendor.pyproject_hooks import BuildBackendWarning"],
                            capture_output=True, text=True, timeout=60)
    if relays.returncode != 0:
        pytest.skip("this pip does not print a build backend's warnings (no newer pip to upgrade to)")
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-e", str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "BuildBackendWarning" not in output, output[-3000:]  # setuptools' editable note included
    assert "Editable installation" not in output, output[-3000:]
    assert "absent from the `packages`" not in output


@pytest.mark.slow
def test_the_wheel_carries_the_lua_scripts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("redroll-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "redroll/shared/lua/finish_many.lua" in names and "redroll/shared/scripts.py" in names
