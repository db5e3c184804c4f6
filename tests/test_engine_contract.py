"""The engine contract is all an engine needs: an engine written here from engines/base.py and
engines/example.py alone runs in a real ``redroll worker`` process (``--engine module:Class``),
which honours its declared capacity when claiming, classifies its errors, streams it and feeds it
text prompts and chats."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from redroll.engine_worker.engines.base import (
    EngineDeadError,
    EngineOutput,
    EngineRequestError,
    EngineSpec,
)
from redroll.engine_worker.engines.declaration import check_declaration
from redroll.engine_worker.engines.example import ExampleEngine
from redroll.producer.client import Producer
from redroll.shared.codec import ValidationError
from redroll.shared.types import RecordStatus
from tests.conftest import spawn
from tests.support.processes import stop_process

ENGINE = "tests.test_engine_contract:ContractEngine"


class ContractEngine(ExampleEngine):
    """The example engine, plus what the test watches: how many generations it was handed at once,
    and an error of each kind on a marker in the prompt (``--engine-arg die_once=PATH``: the engine
    dies the first time it meets "die", and leaves PATH behind so a second engine does not)."""

    spec = EngineSpec(name="contract", factory=ENGINE, summary="the contract test's engine", loads_model=False)

    def __init__(self, *, capacity: int = 2, token_ms: float = 5.0, die_once: str | None = None) -> None:
        super().__init__(capacity=capacity, token_ms=token_ms)
        self.die_once = die_once
        self.handed = 0
        self.peak_handed = 0

    async def generate(self, request, handle) -> EngineOutput:
        prompt = request.prompt or ""
        if "request-error" in prompt:
            raise EngineRequestError("this request upset the engine")
        if "refuse-late" in prompt:
            raise ValidationError("prompt", "refused while generating")
        if "die" in prompt and self.die_once and not os.path.exists(self.die_once):
            Path(self.die_once).write_text("died")
            raise EngineDeadError("the engine's process is gone")
        self.handed += 1
        self.peak_handed = max(self.peak_handed, self.handed)
        try:
            output = await super().generate(request, handle)
        finally:
            self.handed -= 1
        output.extra["peak_handed"] = self.peak_handed
        return output


def test_the_contract_test_engine_declares_what_it_has():
    assert check_declaration(ContractEngine()) == []


def _worker(settings, tmp_path, name: str, *extra: str):
    return spawn(settings, "worker", "--engine", ENGINE, "--name", name, "--engine-arg", "capacity=2",
                 "--engine-arg", f"die_once={tmp_path / 'died'}", *extra, log=tmp_path / f"{name}.log")


async def _heartbeat(r, settings, name: str) -> dict:
    while (raw := await r.hget(settings.keys.workers, name)) is None:
        await asyncio.sleep(0.05)
    return json.loads(raw)


async def test_capacity_text_chats_and_streaming_through_a_real_worker(settings, r, tmp_path):
    worker = _worker(settings, tmp_path, "contract-1", "--engine-arg", "token_ms=20")
    try:
        beat = await _heartbeat(r, settings, "contract-1")
        prefetch = settings.claim_prefetch
        # Capacity 2 declared: the worker holds 2 + the prefetch, and max_inflight follows it.
        assert (beat["claim_limit"], beat["max_inflight"]) == (2 + prefetch, 2 + prefetch), beat
        async with Producer(settings) as producer:
            texts = [f"prompt number {i}" for i in range(10)]
            futures = [await producer.submit(prompt=t, sampling_params={"max_new_tokens": 64}) for t in texts]
            chat = await producer.submit(messages=[{"role": "user", "content": "hi"}],
                                         sampling_params={"max_new_tokens": 64})
            records = [await asyncio.wait_for(f, 60) for f in futures]
            assert [rec.output_text[0] for rec in records] == texts  # (spelled back, EOS dropped)
            assert all(rec.finish_reasons == ["stop"] for rec in records)
            # Never handed more than it holds: what it can run plus the prefetch.
            assert max(rec.meta_info["peak_handed"] for rec in records) <= 2 + prefetch
            assert (await asyncio.wait_for(chat, 60)).output_text == ["user: hi\nassistant:"]
            chunks = [c async for c in producer.stream(prompt="streamed, one token at a time",
                                                       sampling_params={"max_new_tokens": 64})]
            assert len(chunks) >= 3  # (several chunks while it generated, then the record's)
            assert "".join(c.text for c in chunks) == "streamed, one token at a time"
            assert [t for c in chunks for t in c.token_ids] == chunks[-1].record.output_token_ids[0]
    finally:
        assert stop_process(worker) == 0


async def test_errors_are_classified_as_the_contract_says(settings, r, tmp_path):
    first = _worker(settings, tmp_path, "contract-a", "--engine-arg", "token_ms=30")
    second = None
    try:
        await _heartbeat(r, settings, "contract-a")
        async with Producer(settings) as producer:
            late = await producer.submit(prompt="refuse-late", sampling_params={"max_new_tokens": 8})
            record = await asyncio.wait_for(late, 30)
            # A ValidationError from generate: refused at once, naming the field, no second attempt.
            assert record.status is RecordStatus.ERROR and "prompt" in record.error, record.error
            assert "refused while generating" in record.error
            dead = await r.xrange(settings.keys.dead)
            assert [int(f[b"deliveries"]) for _id, f in dead] == [1]

            failing = await producer.submit(prompt="request-error", sampling_params={"max_new_tokens": 8})
            record = await asyncio.wait_for(failing, 60)
            # An EngineRequestError: handed back and tried again until max_deliveries, its error kept.
            assert record.status is RecordStatus.ERROR
            assert "EngineRequestError: this request upset the engine" in record.error, record.error
            assert f"max_deliveries={settings.max_deliveries}" in record.error

            # An EngineDeadError: the worker hands everything back and exits 1; another takes it all.
            slow = [await producer.submit(prompt=f"a long one {i}" * 4, sampling_params={"max_new_tokens": 64})
                    for i in range(2)]
            while not await r.xpending(settings.keys.requests, "workers") or \
                    (await r.xpending(settings.keys.requests, "workers"))["pending"] < 2:
                await asyncio.sleep(0.02)
            doomed = await producer.submit(prompt="die", sampling_params={"max_new_tokens": 8})
            assert await asyncio.to_thread(first.wait, 60) == 1
            assert (tmp_path / "died").exists()
            second = _worker(settings, tmp_path, "contract-b")
            for future in [*slow, doomed]:
                record = await asyncio.wait_for(future, 60)
                assert record.status is RecordStatus.FINISHED and record.worker == "contract-b", record
            # Handed back on purpose, at once: never dead-lettered, no error noted against them.
            assert len(await r.xrange(settings.keys.dead)) == 2
    finally:
        if first.poll() is None:
            stop_process(first)
        if second is not None:
            assert stop_process(second) == 0
