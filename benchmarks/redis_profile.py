"""Where redis-server's CPU goes in the ceiling flow, by function: a ``perf`` profile.

    python -m benchmarks.redis_profile [--requests 20000] [--redis-server PATH] [--json-out FILE]

The ceiling section prints redis-server's CPU per request and ``INFO commandstats``, which times
each command's own function (a script's figure includes the commands it runs). This splits the
whole server CPU instead: ``perf record -g`` on the server during one ceiling run (producer
process, one synthetic worker, one consumer: ``benchmarks.runs.queue_run``), each sample put in
one part by the functions on its stack. Each part's share times the server's CPU per request over
the run gives its microseconds.

Needs Linux ``perf`` and a redis-server with symbols and frame pointers; distribution builds are
stripped. From the release's source (Debian: ``apt-get source redis``)::

    make USE_SYSTEM_JEMALLOC=yes OPTIMIZATION="-O2 -fno-omit-frame-pointer" CFLAGS="-fno-omit-frame-pointer -g"

(``USE_SYSTEM_JEMALLOC`` with Debian's patches applied; upstream's tree builds without it.)
Samples whose stack a library without frame pointers cut (mostly the allocator) are shown as
their own part, not guessed at.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from benchmarks.harness import Server, new_run_dir
from benchmarks.runs import queue_run

SCRIPT = "evalGenericCommand"
PARTS = {
    "script_arguments": "script: its KEYS and ARGV made into Lua strings (hashed, interned, collected)",
    "script_commands": "script: the commands it runs",
    "script_crossing": "script: each redis.call's way in and out (argv from Lua, the reply into Lua)",
    "script_lua": "script: the interpreter, Lua's garbage collector, the call's setup",
    "commands": "commands sent on their own",
    "io": "reading and parsing commands, writing replies, the event loop",
    "unattributed": "stack cut by a library without frame pointers (mostly the allocator), or kernel "
                    "work outside the event loop",
}


def samples(perf_script: str) -> Iterable[list[str]]:
    """The stacks (root first) of ``perf script -F tid,ip,sym`` output: blocks of a header line
    and one ``<address> <symbol>`` line per frame, leaf first."""
    for block in perf_script.split("\n\n"):
        lines = [line.split() for line in block.splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        yield [frame[1] if len(frame) > 1 else "?" for frame in reversed(lines[1:])]


def _command_under(stack: list[str], start: int) -> str:
    """The command a sample was in: the function ``call()`` ran next below ``stack[start]`` (a
    command's own, ``xaddCommand`` -> ``XADD``), else what ran around it."""
    try:
        below = stack[stack.index("call", start) + 1:]
    except ValueError:
        return "(checks before the call: command lookup, ACL)"
    if not below:
        return "(call's own bookkeeping)"
    name = below[0]
    for suffix in ("GenericCommand", "Command"):
        if name.endswith(suffix):
            command = name[:-len(suffix)].upper()
            return {"XREAD": "XREAD/XREADGROUP", "EXEC": "MULTI/EXEC"}.get(command, command)
    return "(call's own bookkeeping)"


def classify(stack: list[str]) -> tuple[str, str | None]:
    """(part, command or None) of one sample's stack."""
    if "main" not in stack:
        return "unattributed", None
    if SCRIPT in stack:
        for frame, part in (("luaCreateArray", "script_arguments"), ("scriptCall", "script_commands"),
                            ("luaRedisGenericCommand", "script_crossing")):
            if frame in stack:
                return part, _command_under(stack, stack.index(frame)) if part == "script_commands" else None
        return "script_lua", None
    if "call" in stack:
        return "commands", _command_under(stack, 0)
    return "io", None


def split(stacks: Iterable[list[str]], us_per_request: float) -> dict[str, Any]:
    """Shares and microseconds per request of each part, and of each command (in scripts and alone)."""
    parts: Counter[str] = Counter()
    in_scripts: Counter[str] = Counter()
    alone: Counter[str] = Counter()
    total = 0
    for stack in stacks:
        part, command = classify(stack)
        total += 1
        parts[part] += 1
        if command is not None:
            (in_scripts if part == "script_commands" else alone)[command] += 1
    if not total or parts["unattributed"] == total:
        raise SystemExit("redis_profile: no sample has redis-server's own functions on its stack: the server "
                         "has no symbols or frame pointers (see this module's help for a build that has them)")

    def us(count: int) -> dict[str, float]:
        return {"share": round(count / total, 4), "us_per_request": round(count / total * us_per_request, 2)}

    return {"samples": total, "us_per_request": us_per_request,
            "parts": {name: {"what": what, **us(parts[name])} for name, what in PARTS.items()},
            "commands_in_scripts": {k: us(v) for k, v in in_scripts.most_common()},
            "commands_alone": {k: us(v) for k, v in alone.most_common()}}


def profile(server: Server, requests: int, base: Path, frequency: int = 4000) -> dict[str, Any]:
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("redis_profile: needs Linux perf (Debian: apt-get install linux-perf)")
    pid = int(server.r.info("server")["process_id"])
    data = base / "perf.data"
    recording: list[subprocess.Popen] = []
    cpu: list[float] = []
    log = open(base / "perf-record.log", "wb")

    def start() -> None:
        recording.append(subprocess.Popen([perf, "record", "-F", str(frequency), "-g", "-o", str(data), "-p",
                                           str(pid)], stdout=log, stderr=subprocess.STDOUT))
        time.sleep(0.5)  # (perf attaches before the producer starts)
        cpu.append(server.cpu_s())

    def stop(_procs: Any) -> None:
        cpu.append(server.cpu_s())
        recording[0].send_signal(signal.SIGINT)
        recording[0].wait(60)

    with log:
        run = queue_run(server, new_run_dir(base, "ceiling"), requests, on_ready=start, after_done=stop)
    if not data.exists():  # (perf_event_paranoid, a container without the capability, ...)
        raise SystemExit("redis_profile: perf record wrote nothing: "
                         + (base / "perf-record.log").read_text(errors="replace").strip()[-500:])
    text = subprocess.run([perf, "script", "-i", str(data), "-F", "tid,ip,sym"], capture_output=True, text=True,
                          check=True).stdout
    out = split(samples(text), round((cpu[1] - cpu[0]) * 1e6 / requests, 2))
    out.update(requests=requests, requests_per_s=round(run.rate, 1), server=server.version())
    return out


def render(result: dict[str, Any]) -> str:
    rows = [f"redis-server {result['server']}: {result['us_per_request']} us of CPU a request "
            f"({result['requests']} requests at {result['requests_per_s']:,.0f}/s; {result['samples']} samples)"]
    for name, p in result["parts"].items():
        rows.append(f"  {p['us_per_request']:6.2f} us  {p['share'] * 100:5.1f}%  {p['what']}")
    for title, key in (("commands in scripts", "commands_in_scripts"), ("commands alone", "commands_alone")):
        rows.append(f"  {title}: " + ", ".join(f"{k} {v['us_per_request']}" for k, v in result[key].items()))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.redis_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--redis-server", help="the server binary (default: redis-server on PATH)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    server = Server(executable=args.redis_server)
    try:
        with tempfile.TemporaryDirectory(prefix="redroll-profile-") as tmp:
            result = profile(server, args.requests, Path(tmp))
    finally:
        server.stop()
    print(render(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
