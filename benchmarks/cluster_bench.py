"""Throughput of one pipeline on a local 3-node Redis Cluster with P = 1, 3 and 6 partitions.

    python -m benchmarks.cluster_bench [--requests N] [--partitions 1,3,6] [--workers W] [--json-out FILE]

The same three-hop flow as the suite's ceiling section (producer process → W worker processes,
synthetic engine with zero delay → one consumer process), each role with ``--cluster
--partitions P``, against three cluster-enabled servers (primaries, loopback, no persistence)
started here. With P = 1 every key lives on one node; with P = 3 and 6 the partitions' hash tags
spread the keys over the nodes (the namespace is picked so that they cover all three). Prints a
table and the JSON document; the per-node CPU shows where the load went.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import redis
from redis.crc import key_slot

from benchmarks.harness import Procs, machine_info, make_base_dir, new_run_dir, read_json, redroll_env, wait_for
from benchmarks.runs import CONSUMER_GROUP, consumer_argv, producer_argv, redroll_worker_argv
from redroll.shared.keys import Keys, partition_keys
from redroll.testing.embedded import RedisCluster, start_redis_cluster


def spread_namespace(partitions: int, primaries: int = 3) -> str:
    """A namespace whose partitions cover as many nodes' slot ranges as they can."""
    want = min(partitions, primaries)
    for i in range(10_000):
        ns = f"bench{i}"
        if partitions == 1:
            return ns
        ranges = {key_slot(Keys(ns, p).requests.encode()) * primaries // 16384 for p in range(partitions)}
        if len(ranges) == want:
            return ns
    raise RuntimeError("no namespace spreads the partitions")


def node_cpu(cluster: RedisCluster) -> list[float]:
    out = []
    for node in cluster.nodes:
        info = redis.Redis(port=node.port).info("cpu")
        out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out


def run_once(cluster: RedisCluster, rc: redis.RedisCluster, base: Path, partitions: int, n: int,
             workers: int) -> dict:
    for node in cluster.nodes:
        c = redis.Redis(port=node.port)
        c.flushall()
        c.script_flush()
    ns = spread_namespace(partitions, cluster.primaries)
    keys = Keys(ns)
    parts = partition_keys(ns, partitions)
    run_dir = new_run_dir(base, f"p{partitions}")
    done_file = run_dir / "consumer.json"
    prod_file = run_dir / "producer.json"
    env = dict(REDROLL_REDIS_CLUSTER="1", REDROLL_PARTITIONS=str(partitions))
    seed = SimpleNamespace(url=cluster.url)
    with Procs(run_dir) as procs:
        for i in range(workers):
            procs.spawn(f"worker{i}", redroll_worker_argv(token_ms=0, max_inflight=256), redroll_env(seed, ns, **env))
        procs.spawn("consumer", consumer_argv("count"),
                    redroll_env(seed, ns, BENCH_EXPECT=n, BENCH_DONE_FILE=done_file, **env))

        def groups_ready() -> bool:
            try:
                return all(any(g["name"] in (CONSUMER_GROUP, CONSUMER_GROUP.encode()) for g in rc.xinfo_groups(p.results))
                           for p in parts)
            except redis.ResponseError:
                return False

        wait_for(lambda: rc.hlen(keys.workers) >= workers, 60, "workers to register", procs=procs)
        wait_for(groups_ready, 60, "the consumer group", procs=procs)
        time.sleep(0.3)
        cpu0 = procs.sample_cpu()
        ncpu0 = node_cpu(cluster)
        procs.spawn("producer", producer_argv(n, prod_file, chunk=500), redroll_env(seed, ns, **env))
        wait_for(done_file.exists, max(120, n / 100), f"{n} callbacks", procs=procs, allow_exited=("producer",))
        cpu1 = procs.sample_cpu()
        ncpu1 = node_cpu(cluster)
        wait_for(prod_file.exists, 30, "the producer's report", procs=procs, allow_exited=("producer",))
        produced, consumed = read_json(prod_file), read_json(done_file)
    elapsed = float(consumed["t_last"]) - float(produced["t_first"])
    cpu = {k: round((cpu1[k] - cpu0.get(k, 0.0)) * 1e6 / n, 1) for k in cpu1 if k != "producer"}
    cpu["producer"] = round(float(produced["cpu_s"]) * 1e6 / n, 1)
    nodes_used = sorted({rc.get_node_from_key(p.requests).port for p in parts})
    return {
        "partitions": partitions, "requests": n, "workers": workers, "elapsed_s": round(elapsed, 3),
        "rps": round(n / elapsed, 1), "nodes_holding_partitions": len(nodes_used),
        "cpu_us_per_request": cpu,
        "node_cpu_us_per_request": [round((b - a) * 1e6 / n, 1) for a, b in zip(ncpu0, ncpu1)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cluster_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--partitions", default="1,3,6")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.partitions.split(",") if x.strip()]

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    base = make_base_dir()
    cluster = start_redis_cluster(3, "--loglevel", "warning")
    rc = redis.RedisCluster.from_url(cluster.url)
    runs = []
    started = time.time()
    try:
        for p in counts:
            console.print(f"[bold]P = {p}[/bold] ...")
            runs.append(run_once(cluster, rc, base, p, args.requests, args.workers))
            console.print(f"P = {p}: {runs[-1]['rps']:,.0f} req/s")
        version = str(redis.Redis(port=cluster.nodes[0].port).info("server")["redis_version"])
    finally:
        rc.close()
        cluster.stop()
    doc = {
        "suite": "redroll-cluster-bench",
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine_info(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "cluster": {"nodes": 3, "version": version, "persistence": "none", "transport": "TCP loopback"},
        "runs": runs,
    }
    table = Table(title=f"redroll on a 3-node Redis Cluster ({args.requests:,} requests, {args.workers} worker(s))")
    for col in ("partitions", "nodes used", "req/s", "elapsed s", "node CPU µs/req"):
        table.add_column(col, justify="right")
    for run in runs:
        table.add_row(str(run["partitions"]), str(run["nodes_holding_partitions"]), f"{run['rps']:,.0f}",
                      f"{run['elapsed_s']:.2f}", " / ".join(f"{x:.0f}" for x in run["node_cpu_us_per_request"]))
    Console(width=None if sys.stdout.isatty() else 132).print(table)
    text = json.dumps(doc, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
