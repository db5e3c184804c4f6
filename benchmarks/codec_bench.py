"""Codec micro-benchmark: request decode, large-record encode and decode, before and after.

"Before" is the hand-written codec as it was in git just before the msgspec Structs replaced it
(loaded from that commit into a private package, so both run in the same process and run);
"after" is this checkout's ``redroll.shared.codec``. Prints a table and, with ``--json-out``, JSON.

    python -m benchmarks.codec_bench [--before REV] [--quick] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def before_revision() -> str:
    """The parent of the commit that removed the hand-written validator from shared/codec.py."""
    out = subprocess.run(["git", "log", "-S", "def validate_request_map", "--format=%H", "-n", "1", "--",
                          "shared/codec.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    if not out:
        raise SystemExit("codec_bench: no commit removed the hand-written codec (is this a git checkout?)")
    return f"{out}^"


def load_codec_at(rev: str, workdir: Path) -> ModuleType:
    """``shared/codec.py`` (and the ``shared`` modules it imports: types, and from when the codec was
    split, the record codec and validation) of ``rev``, as package ``_codec_before``."""
    package = workdir / "_codec_before"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("codec.py", "types.py", "record_codec.py", "validation.py"):
        shown = subprocess.run(["git", "show", f"{rev}:shared/{name}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode != 0 and name in ("record_codec.py", "validation.py"):
            continue  # (not split yet at rev)
        shown.check_returncode()
        # (its imports of the modules copied here point at the copies, whether relative or absolute)
        (package / name).write_text(re.sub(r"\bredroll\.shared\.(codec|types|record_codec|validation)\b",
                                           r"_codec_before.\1", shown.stdout))
    sys.path.insert(0, str(workdir))
    try:
        return importlib.import_module("_codec_before.codec")
    finally:
        sys.path.remove(str(workdir))


def best_of(fn: Callable[[], Any], repeat: int, number: int) -> float:
    """Seconds per call: the best of ``repeat`` rounds of ``number`` calls."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - started) / number)
    return best


def measure(codec: ModuleType, quick: bool) -> dict[str, float]:
    types = sys.modules[codec.__name__.rpartition(".")[0] + ".types"]
    req = types.GenerationRequest(
        request_id="3f2b6c1e-9a4d-4c6b-8f3e-2a1b0c9d8e7f_12", input_ids=list(range(1000, 1040)),
        sampling_params=types.SamplingParams(max_new_tokens=512, temperature=0.8, top_p=0.95, n=1),
        return_logprob=True, meta_info={"step": 12, "group_index": 3}, reply_to="{redroll}:reply:trainer-0",
        group_id="3f2b6c1e-9a4d-4c6b-8f3e-2a1b0c9d8e7f", submitted_at=1_800_000_000.0)
    fields = codec.encode_request(req)
    n, tokens = 8, 4096
    rec = types.CompletionRecord(
        request_id="large-1", status=types.RecordStatus.FINISHED,
        output_token_ids=[[(i * 7919 + s) % 150000 for i in range(tokens)] for s in range(n)],
        finish_reasons=["length"] * n,
        output_logprobs=[[-((i * 31 + s) % 997) / 100.0 for i in range(tokens)] for s in range(n)],
        meta_info={"prompt_tokens": 40, "completion_tokens": n * tokens, "weight_version": "7"}, worker="w")
    rec_fields = codec.encode_record(rec)
    scale = 10 if quick else 1
    return {
        "request_decode_us": best_of(lambda: codec.decode_request(fields), 5, 20_000 // scale) * 1e6,
        "large_record_encode_ms": best_of(lambda: codec.encode_record(rec), 5, 50 // scale) * 1e3,
        "large_record_decode_ms": best_of(lambda: codec.decode_record(rec_fields), 5, 50 // scale) * 1e3,
        "large_record_bytes": len(rec_fields["data"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.codec_bench", description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="git revision of the 'before' codec (default: found in git log)")
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    from redroll.shared import codec as after

    rev = args.before or before_revision()
    with tempfile.TemporaryDirectory() as tmp:
        before = load_codec_at(rev, Path(tmp))
        results = {"before": measure(before, args.quick), "after": measure(after, args.quick), "before_rev": rev}
    print(f"{'figure':<28} {'before':>12} {'after':>12} {'speed-up':>9}")
    for key in ("request_decode_us", "large_record_encode_ms", "large_record_decode_ms"):
        b, a = results["before"][key], results["after"][key]
        print(f"{key:<28} {b:>12.2f} {a:>12.2f} {b / a:>8.1f}x")
    print(f"{'large_record_bytes':<28} {results['before']['large_record_bytes']:>12} "
          f"{results['after']['large_record_bytes']:>12}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
