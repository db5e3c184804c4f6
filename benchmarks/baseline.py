"""The code a performance target was set against, measured by its own bench in the same run.

The performance issue set "large records end to end ≥ 2× today's code in the same run" at commit
``b3635ad`` (124 records/s then). A constant from another day says little on a machine whose speed
drifts, so the large section runs that commit's own ``benchmarks.bench --only large`` between its
own runs, on the same machine, and compares medians. The commit is taken out of this repository's
history with ``git archive`` into the run directory; without git or that commit (a shallow clone, an
unpacked wheel) the comparison is skipped with the reason.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT

LARGE_BASELINE = "b3635ad"
"""The commit the performance issue measured its large-record figure on."""


class BaselineUnavailable(RuntimeError):
    pass


def checkout(rev: str, base: Path) -> Path:
    """``rev``'s tree, unpacked under ``base`` (once per run)."""
    dest = base / f"baseline-{rev}"
    if dest.exists():
        return dest
    if shutil.which("git") is None:
        raise BaselineUnavailable("git is not installed")
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True,
                             timeout=120, check=True).stdout
    except subprocess.CalledProcessError as exc:
        reason = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or ["git archive failed"]
        raise BaselineUnavailable(f"commit {rev} is not in this checkout's history: {reason[0]}") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BaselineUnavailable(f"git archive {rev}: {exc}") from None
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        try:
            archive.extractall(dest, filter="data")
        except TypeError:  # Python before 3.11.4 has no filter (the tree is this repository's own)
            archive.extractall(dest)
    return dest


def large_run(src: Path, out: Path, *, quick: bool = False, timeout: float = 600.0) -> dict[str, Any]:
    """One run of the large section of the bench in ``src`` (its own redis-server and processes):
    its figures, and its CPU per record."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDROLL_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(src)
    argv = [sys.executable, "-m", "benchmarks.bench", "--only", "large", "--json-out", str(out)]
    proc = subprocess.run(argv + (["--quick"] if quick else []), cwd=src, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise BaselineUnavailable(f"its bench exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    section = json.loads(out.read_text())["sections"]["large"]
    if "error" in section:
        raise BaselineUnavailable(f"its large section failed: {section['error'][:300]}")
    return {"figures": section["figures"], "cpu_us_per_record": section["details"]["e2e"].get("cpu_us_per_record")}
