"""redroll benchmark suite.

    python -m benchmarks.bench [--quick] [--only NAME,...] [--json-out FILE]

Sections: ceiling, latency, utilisation, large, peers, memory, fleet (in that order). Every role runs as
its own OS process against one private redis-server started here (no persistence: ``--save ''
--appendonly no``, loopback port). Prints a table (rich) and then the JSON document on stdout.
Exit code 1 when a section failed (a skipped peer is not a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from datetime import datetime, timezone
from typing import Callable

from benchmarks import sections
from benchmarks.fleet import fleet
from benchmarks.harness import BenchError, Server, compile_checkout, machine_info, make_base_dir, raise_fd_limit
from benchmarks.results import SectionResult

SECTION_ORDER = ("ceiling", "latency", "utilisation", "large", "peers", "memory", "fleet")


def _peers(server, cfg, base, res):  # imported lazily: it may create virtualenvs
    from benchmarks.peers_section import peers

    peers(server, cfg, base, res)


RUNNERS: dict[str, Callable] = {
    "ceiling": sections.ceiling,
    "latency": sections.latency,
    "utilisation": sections.utilisation,
    "large": sections.large,
    "peers": _peers,
    "memory": sections.memory,
    "fleet": fleet,
}


def render_table(results: list[SectionResult], title: str):
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("section", style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("target")
    table.add_column("met")
    for res in results:
        if res.error:
            table.add_row(res.name, "[red]error[/red]", "", "", "", "", end_section=True)
            continue
        if res.skipped and not res.figures:
            table.add_row(res.name, f"[yellow]skipped: {res.skipped[:60]}[/yellow]", "", "", "", "", end_section=True)
            continue
        items = list(res.figures.items())
        for i, (name, f) in enumerate(items):
            met = "" if f.met is None else ("[green]yes[/green]" if f.met else "[red]no[/red]")
            value = f"{f.value:,.3f}" if abs(f.value) < 100 else f"{f.value:,.0f}"
            table.add_row(res.name if i == 0 else "", name, value, f.unit, f.target or "", met,
                          end_section=(i == len(items) - 1))
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts: a smoke run (< 60 s without peers' installs)")
    ap.add_argument("--only", default="", help=f"comma-separated sections among {','.join(SECTION_ORDER)}")
    ap.add_argument("--json-out", default=None, help="also write the JSON document here")
    ap.add_argument("--ceiling-requests", type=int, default=None, help="requests in the ceiling section")
    ap.add_argument("--memory-requests", type=int, default=None, help="requests in the memory section")
    ap.add_argument("--peer-jobs", type=int, default=None, help="jobs per peer")
    ap.add_argument("--peer-runs", type=int, default=None, help="runs of the peers section (default 5; 1 with --quick)")
    ap.add_argument("--workers", type=int, default=None, help="workers in the fleet section (default 1024)")
    ap.add_argument("--fleet-ceiling-workers", type=int, default=None,
                    help="the fleet compared with 4 workers at the ceiling (default 256)")
    ap.add_argument("--fleet-processes", type=int, default=None, help="host processes the fleet is spread over")
    ap.add_argument("--fleet-idle-s", type=float, default=None, help="seconds of idle measured per fleet layout")
    ap.add_argument("--fleet-requests", type=int, default=None, help="requests per fleet ceiling run")
    ap.add_argument("--fleet-runs", type=int, default=None, help="ceiling runs per fleet size (median kept)")
    ap.add_argument("--large-runs", type=int, default=None,
                    help="end-to-end runs in the large section (default 5; 1 with --quick)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the run directory (process logs)")
    args = ap.parse_args(argv)

    selected = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTION_ORDER)
    unknown = [s for s in selected if s not in RUNNERS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose among {', '.join(SECTION_ORDER)}")
    selected = [s for s in SECTION_ORDER if s in selected]
    cfg = sections.Config.make(args.quick)
    if args.ceiling_requests:
        cfg.ceiling_requests = args.ceiling_requests
    if args.memory_requests:
        cfg.memory_requests = args.memory_requests
    if args.peer_jobs:
        cfg.peer_jobs = args.peer_jobs
    if args.large_runs is not None:
        cfg.large_runs = args.large_runs
    for name in ("peer_runs", "workers", "fleet_processes", "fleet_idle_s", "fleet_requests", "fleet_runs",
                 "fleet_ceiling_workers"):
        value = getattr(args, name)
        if value:
            setattr(cfg, "fleet_workers" if name == "workers" else name, value)

    from rich.console import Console

    console = Console(stderr=True)
    compile_checkout()
    raise_fd_limit()  # (redis-server, started below, inherits it: a fleet of workers needs a descriptor each)
    base = make_base_dir()
    load_start = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    server = Server()
    results: list[SectionResult] = []
    context: dict = {}
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    # Redrawn at each section's start and end only: a refresh thread would draw (and take the GIL)
    # ten times a second in this process while the sections measure the CPU.
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("sections"), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                        auto_refresh=False)
    bar = progress.add_task("bench", total=len(selected))
    progress.start()
    try:
        for name in selected:
            progress.update(bar, description=name, refresh=True)
            res = SectionResult(name)
            res.details["_context"] = context  # lets peers read the ceiling figure of this run
            console.print(f"[bold]{name}[/bold] ...")
            t0 = time.monotonic()
            try:
                RUNNERS[name](server, cfg, base, res)
            except BenchError as exc:
                res.error = str(exc)
            except Exception as exc:  # a bug in a section must not lose the others' figures
                res.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            res.wall_s = time.monotonic() - t0
            res.details.pop("_context", None)
            if name == "ceiling" and "redroll_rps" in res.figures:
                context["ceiling_rps"] = res.figures["redroll_rps"].value
            if res.error:
                console.print(f"[red]{name} failed:[/red] {res.error}")
            else:
                console.print(f"[bold]{name}[/bold] done in {res.wall_s:.1f}s")
            results.append(res)
            progress.advance(bar)
            progress.refresh()
        redis_version = server.version()
    finally:
        progress.stop()
        server.stop()
        if not args.keep_logs:
            shutil.rmtree(base, ignore_errors=True)
        else:
            console.print(f"logs kept in {base}")
    wall = time.time() - started
    doc = {
        "suite": "redroll-bench",
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(wall, 1),
        "quick": args.quick,
        "config": {k: v for k, v in vars(cfg).items()},
        "machine": {**machine_info(), "loadavg_at_start": load_start,
                    "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "redis_server": {"version": redis_version, "persistence": "none (--save '' --appendonly no)",
                         "transport": "TCP loopback"},
        "sections": {r.name: r.to_json() for r in results},
    }
    text = json.dumps(doc, indent=2, default=str)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(text + "\n")
    out = Console(width=None if sys.stdout.isatty() else 132)
    out.print(render_table(results, f"redroll bench ({'quick' if args.quick else 'full'}, {wall:.0f} s wall)"))
    print(text, flush=True)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
