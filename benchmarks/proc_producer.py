"""A producer process: fire-and-forget ``redroll.producer.client.send`` of benchmark requests.

``--rate 0`` (burst): ``--chunk`` requests per ``send`` (one pipelined round trip), as fast as it
goes. ``--rate R``: one request per ``send``, paced at R per second on an absolute schedule, each
stamped with ``meta_info.bench_submitted_at`` just before it is sent.

Writes ``{"t_first", "t_last", "count", "data_bytes"}`` (unix seconds) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.harness import write_json_atomic
from benchmarks.payload import INPUT_LEN, MAX_NEW_TOKENS, make_requests
from redroll.cli.runtime import run as run_async_main
from redroll.producer.client import send
from redroll.shared.codec import encode_request
from redroll.shared.connection import connect
from redroll.shared.settings import Settings


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--input-len", type=int, default=INPUT_LEN)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--logprob", action="store_true")
    ap.add_argument("--callback", default="h")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    settings = Settings.from_env()
    r = connect(settings)
    await r.ping()
    shape = dict(input_len=args.input_len, max_new_tokens=args.max_new_tokens, n=args.n, logprob=args.logprob,
                 callback=args.callback)
    sample = next(make_requests(1, **shape))
    sample.reply_to = settings.keys.results
    data_bytes = len(encode_request(sample)["data"])
    cpu0 = time.process_time()
    t_first = time.time()
    sent = 0
    if args.rate <= 0:
        while sent < args.count:
            k = min(args.chunk, args.count - sent)
            await send(settings, r, make_requests(k, start=sent, **shape))
            sent += k
    else:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for req in make_requests(args.count, **shape):
            due = start + sent / args.rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            req.submitted_at = time.time()  # (made before the pacing sleep)
            req.meta_info = {"bench_submitted_at": req.submitted_at}
            await send(settings, r, [req])
            sent += 1
    t_last = time.time()
    await r.aclose()
    write_json_atomic(args.out, {"t_first": t_first, "t_last": t_last, "count": sent, "data_bytes": data_bytes,
                                 "cpu_s": time.process_time() - cpu0})


if __name__ == "__main__":
    run_async_main(main())
