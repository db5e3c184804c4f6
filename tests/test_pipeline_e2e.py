"""The whole path with real processes: 200 requests, 2 transformers workers, 2 consumer processes."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import pytest

from redroll.producer.client import make_request, send
from redroll.shared.keys import WORKERS_GROUP
from tests.conftest import read_jsonl, spawn, wait_until

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from redroll.engine_worker.engines.tiny_model import ByteTokenizer, build_tiny_model, teacher_forced_logprobs  # noqa: E402

N_REQUESTS = 200
GROUP = "trainer"


def _requests() -> list:
    tok = ByteTokenizer()
    out = []
    for i in range(N_REQUESTS):
        text = f"prompt {i}: the queue {'x' * (i % 17)}"
        temperature = (0.0, 0.7, 1.0)[i % 3]
        sp = {"max_new_tokens": 6 + i % 7, "temperature": temperature, "n": 4 if i % 10 == 0 else 1,
              "sampling_seed": i}
        if i % 4 == 1:
            sp.update(top_k=20, top_p=0.9)
        kw = {"prompt": text} if i % 2 else {"input_ids": tok.encode(text)}
        out.append(make_request(request_id=f"e2e-{i:04d}_{i % 5}", callback="apply", return_logprob=True,
                                meta_info={"i": i, "temperature": temperature, "text": text},
                                sampling_params=sp, **kw))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_200_requests_two_workers_two_consumers(settings, r, tmp_path):
    applied_file = tmp_path / "applied.jsonl"
    logs = tmp_path / "procs.log"
    settings_long = settings.with_(claim_idle_ms=30_000)  # no reclaim races: this is the normal case
    workers = [spawn(settings_long, "worker", "--engine", "transformers", "--model-path", "tiny-random",
                     "--max-inflight", "32", log=logs) for _ in range(2)]
    consumers: list = []
    try:
        await wait_until(lambda: _hlen_is(r, settings.keys.workers, 2), timeout=60)
        requests = _requests()
        await send(settings, r, requests)
        # burst consumers: each exits (0) once no request is queued or claimed and nothing is left
        # for the group, so every record was applied and acked when both have exited
        consumers = [spawn(settings_long, "consume", "--group", GROUP, "--burst",
                           "--handler", "apply=tests.handlers:append_to_file",
                           log=logs, REDROLL_TEST_APPLIED=str(applied_file)) for _ in range(2)]
        consumer_codes = [await asyncio.to_thread(c.wait, 240) for c in consumers]
        lines = read_jsonl(applied_file)
    finally:
        for p in workers + consumers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(30) for p in workers + consumers]
    assert consumer_codes == [0, 0]
    if any(codes):
        print(logs.read_text()[-5000:])
    assert codes == [0, 0, 0, 0]

    counts = Counter(x["request_id"] for x in lines)
    assert set(counts) == {req.request_id for req in requests}
    assert max(counts.values()) == 1, "a callback was applied twice"
    assert len({x["meta_info"]["worker"] for x in lines}) == 2, "both workers generated"

    model = build_tiny_model(seed=0)
    tok = ByteTokenizer()
    by_id = {req.request_id: req for req in requests}
    worst = 0.0
    for x in lines:
        req = by_id[x["request_id"]]
        assert x["status"] == "finished"
        assert len(x["ids"]) == req.sampling_params.n == len(x["logprobs"]) == len(x["finish_reasons"])
        prompt_ids = req.input_ids if req.input_ids is not None else tok.encode(req.prompt)
        assert x["meta_info"]["prompt_tokens"] == len(prompt_ids)
        for ids, lps in zip(x["ids"], x["logprobs"]):
            assert len(ids) == len(lps) > 0
            expected = teacher_forced_logprobs(model, prompt_ids, ids, req.sampling_params.temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(lps, expected)))
    assert worst < 1e-4, f"logprobs differ from teacher forcing by {worst}"

    assert await r.xlen(settings.keys.requests) == 0
    assert int((await r.xpending(settings.keys.requests, WORKERS_GROUP))["pending"]) == 0
    assert int((await r.xpending(settings.keys.results, GROUP))["pending"]) == 0
    assert await r.hlen(settings.keys.workers) == 0  # both deregistered on SIGTERM


async def _hlen_is(r, key: str, n: int) -> bool:
    return await r.hlen(key) == n
