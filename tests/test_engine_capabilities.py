"""The engines' declared capabilities (engine_worker/engines/base.py EngineCapabilities): each engine's
declaration matches its members, and the worker calls only what is declared."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from redroll.engine_worker.context import WorkerContext, WorkerStats
from redroll.engine_worker.engines.base import EngineCapabilities
from redroll.engine_worker.engines.declaration import NO_CAPABILITIES, capabilities_of, check_declaration
from redroll.engine_worker.engines.sglang_engine import SGLangEngine
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.engines.transformers_engine import TransformersEngine
from redroll.engine_worker.flights import Flights
from redroll.engine_worker.liveness import Liveness
from redroll.engine_worker.worker import Worker
from redroll.ops.control import send_command
from redroll.producer import Producer
from redroll.producer.client import make_request
from redroll.shared.commands import CommandFailed, SyncWeights, TensorSpec, UpdateWeights, parse_command
from redroll.shared.types import RecordStatus
from tests.conftest import running, wait_until

# ---------------------------------------------------------------- each engine's declaration


@pytest.mark.parametrize("make, declared", [
    (lambda: SyntheticEngine(), {"weights_from_disk", "weights_in_place", "partial_output", "instant",
                                 "progress_counters", "tokenizer"}),
    (lambda: TransformersEngine(), {"weights_from_disk", "weights_in_place", "weights_from_push",
                                    "weights_from_tensor", "partial_output", "progress_counters", "prefill_counters",
                                    "tokenizer", "grammar_resume"}),
    (lambda: SGLangEngine("some/model"), {"weights_from_disk", "weights_in_place", "weights_from_push",
                                          "weights_from_tensor", "memory_release", "partial_output", "tokenizer"}),
], ids=["synthetic", "transformers", "sglang"])
def test_each_engine_declares_exactly_what_it_has(make, declared):
    engine = make()  # (not started: the declaration is the adapter's, not the loaded model's)
    assert set(engine.capabilities.names()) == declared
    assert check_declaration(engine) == []


def test_the_synthetic_engine_is_instant_only_without_per_token_time_or_slots():
    for engine in (SyntheticEngine(token_ms=1), SyntheticEngine(slots=2)):
        assert not engine.capabilities.instant and not engine.instant
        assert check_declaration(engine) == ["SyntheticEngine has generate_now but does not declare instant"]
        assert check_declaration(engine, undeclared=False) == []  # (declared less on purpose)
    assert type(SyntheticEngine()).capabilities.instant is False  # (the class says what every one can do)


def test_check_declaration_names_each_mismatch():
    class Liar:
        capabilities = EngineCapabilities(partial_output=True, memory_release=True, weights_in_place=True)

        def update_weights_from_disk(self, model_path, weight_version=None):  # (sync, no in_place)
            return None

        async def release_memory_occupation(self, tags=None, *, idle_timeout_s: float = 30.0) -> None: ...

        async def resume_memory_occupation(self, required_tags) -> None: ...

    problems = check_declaration(Liar())
    assert "Liar declares memory_release but has no released_tags" in problems
    assert ("Liar declares memory_release: its resume_memory_occupation has no parameter tags" in problems)
    assert "Liar declares partial_output but has no partial" in problems
    assert "Liar declares weights_in_place without weights_from_disk" in problems
    assert "Liar declares no capacity (None: it runs whatever it is given at once)" in problems
    assert len(problems) == 5, problems

    class Modest:
        capabilities = EngineCapabilities(weights_from_disk=True)
        capacity = None

        def partial(self, handle):
            return None

        async def update_weights_from_disk(self, model_path, weight_version=None, *, in_place=False):
            return None

    assert check_declaration(Modest()) == [
        "Modest has partial but does not declare partial_output",
        "Modest's update_weights_from_disk takes in_place but it does not declare weights_in_place"]
    assert check_declaration(Modest(), undeclared=False) == []

    class SyncUpdate:
        capabilities = EngineCapabilities(weights_from_disk=True)
        capacity = None

        def update_weights_from_disk(self, model_path, weight_version=None):
            return None

    assert check_declaration(SyncUpdate()) == [
        "SyncUpdate declares weights_from_disk: its update_weights_from_disk must be async"]


def test_an_engine_object_without_a_declaration_has_no_capabilities():
    class Bare:
        def partial(self, handle):  # (present, but never called: not declared)
            return None

    assert capabilities_of(Bare()) is NO_CAPABILITIES and NO_CAPABILITIES.names() == []

    class Wrong:
        capabilities = {"partial_output": True}

    with pytest.raises(TypeError, match="Wrong.capabilities is a dict, not an EngineCapabilities"):
        capabilities_of(Wrong())


# ---------------------------------------------------------------- the worker asks the declaration


class _Undeclared(SyntheticEngine):
    """Has every method of the synthetic engine but declares nothing: the worker must call none of them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.capabilities = EngineCapabilities()
        self.called: list[str] = []

    async def update_weights_from_disk(self, model_path, weight_version=None, *, in_place=False):
        self.called.append("update_weights_from_disk")
        await super().update_weights_from_disk(model_path, weight_version, in_place=in_place)

    def partial(self, handle):
        self.called.append("partial")
        return super().partial(handle)

    def generate_now(self, request):
        self.called.append("generate_now")
        return super().generate_now(request)

    async def join_weight_group(self, **kw):
        self.called.append("join_weight_group")


async def _command_failed(r, settings, kind: str) -> CommandFailed:
    """The first command_failed for ``kind`` on the control stream (blocking reads: no polling)."""
    position = "0"
    while True:
        for _, entries in await r.xread({settings.keys.control: position}, block=10_000) or []:
            for entry_id, fields in entries:
                position = entry_id
                cmd = parse_command(fields)
                if isinstance(cmd, CommandFailed) and cmd.command == kind:
                    return cmd


async def test_a_disk_update_is_refused_with_a_clear_message_by_an_engine_that_does_not_declare_it(settings, r):
    engine = _Undeclared(token_ms=1)
    worker = Worker(settings, engine, max_inflight=4, block_ms=100)
    async with running(worker), Producer(settings) as p:
        await asyncio.wait_for(worker.started.wait(), 10)
        await send_command(r, settings.keys, UpdateWeights(model_path="/ckpt/step-2", weight_version="2"))
        failed = await asyncio.wait_for(_command_failed(r, settings, "update_weights"), 10)
        # claiming resumed: the refusal left no hold behind
        record = await asyncio.wait_for(await p.submit(prompt="after", sampling_params={"max_new_tokens": 3}), 10)
    assert failed.worker == worker.name
    assert "cannot load weights from disk" in failed.error and "weights_from_disk" in failed.error
    assert engine.called == [] and engine.info.weight_version == "0"
    assert record.status is RecordStatus.FINISHED and record.meta_info["weight_version"] == "0"


async def test_an_update_in_place_quiesces_on_an_engine_that_declares_disk_weights_but_not_in_place(settings, r):
    class NotInPlace(SyntheticEngine):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.capabilities = EngineCapabilities(weights_from_disk=True)
            self.in_place: list[bool] = []

        async def update_weights_from_disk(self, model_path, weight_version=None, *, in_place=False):
            self.in_place.append(in_place)
            await super().update_weights_from_disk(model_path, weight_version)

    engine = NotInPlace(token_ms=1)
    worker = Worker(settings, engine, max_inflight=4, block_ms=100)
    async with running(worker), Producer(settings) as p:
        await asyncio.wait_for(worker.started.wait(), 10)
        await p.update_weights("/ckpt/step-3", "3", mode="in_place", timeout=10)
    assert engine.in_place == [False] and engine.info.weight_version == "3"


async def test_a_push_is_refused_by_an_engine_that_does_not_declare_pushed_weights(settings, r):
    engine = _Undeclared(token_ms=1)
    worker = Worker(settings, engine, max_inflight=4, block_ms=100)
    async with running(worker):
        await asyncio.wait_for(worker.started.wait(), 10)
        await send_command(r, settings.keys, SyncWeights(
            sync_id="s1", attempt=1, version="7", group_name="g", master_address="127.0.0.1", master_port=1,
            world_size=2, backend="gloo", ranks={worker.name: 1}, tensors=[TensorSpec(name="w", dtype="float32",
                                                                                      shape=[2])]))
        key = settings.keys.weight_sync("s1")
        await wait_until(lambda: r.hexists(key, f"{worker.name}:1"))
        status = (await r.hget(key, f"{worker.name}:1")).decode()
    assert status.startswith("failed: the synthetic engine cannot take pushed weights") and "weights_from_push" in status
    assert engine.called == []


@pytest.mark.parametrize("declared", [True, False], ids=["declares-partial-output", "does-not"])
async def test_checkpoints_read_partial_output_only_from_an_engine_that_declares_it(settings, r, declared):
    s = settings.with_(checkpoint_tokens=20, checkpoint_interval_s=0.1, checkpoint_min_new_tokens=50)
    engine = _Undeclared(token_ms=5)
    if declared:
        engine.capabilities = EngineCapabilities(partial_output=True)
    worker = Worker(s, engine, max_inflight=4, block_ms=100)
    request = make_request(request_id="cp-1", input_ids=[1, 2, 3], resumable=True, return_logprob=True,
                           sampling_params={"max_new_tokens": 300, "sampling_seed": 7})
    async with running(worker), Producer(s) as p:
        record = await asyncio.wait_for(await p.submit(request), 20)  # (1.5 s: 15 of the saver's 0.1 s turns)
    assert record.status is RecordStatus.FINISHED and len(record.output_token_ids[0]) == 300
    if declared:
        assert "partial" in engine.called and worker.stats.checkpoints >= 1
    else:
        assert engine.called == [] and worker.stats.checkpoints == 0


class _Paths(SyntheticEngine):
    """Without per-token time (generate_now works); counts which path each request took."""

    def __init__(self, *, instant: bool):
        super().__init__()
        self.capabilities = dataclasses.replace(self.capabilities, instant=instant)
        self.generated = self.made_now = 0

    async def generate(self, request, handle):
        self.generated += 1
        return await super().generate(request, handle)

    def generate_now(self, request):
        self.made_now += 1
        return super().generate_now(request)


@pytest.mark.parametrize("instant", [True, False], ids=["declares-instant", "does-not"])
async def test_the_one_pass_path_runs_only_for_an_engine_that_declares_instant(settings, r, instant):
    engine = _Paths(instant=instant)
    worker = Worker(settings, engine, max_inflight=8, block_ms=100)
    assert worker.capabilities.instant is instant
    async with running(worker), Producer(settings) as p:
        futures = await p.submit_many([dict(request_id=f"i-{i}", prompt="x", sampling_params={"max_new_tokens": 2})
                                       for i in range(6)])
        records = await asyncio.wait_for(asyncio.gather(*futures), 10)
    assert all(rec.status is RecordStatus.FINISHED for rec in records)
    # (generate itself makes the output with generate_now: one call each either way)
    assert (engine.generated, engine.made_now) == ((0, 6) if instant else (6, 6))


@pytest.mark.parametrize("capabilities, fields", [
    (EngineCapabilities(), set()),
    (EngineCapabilities(progress_counters=True), {"tokens_decoded"}),
    (EngineCapabilities(progress_counters=True, prefill_counters=True), {"tokens_decoded", "prefill_tokens"}),
])
async def test_the_heartbeat_reports_the_counters_an_engine_declares(settings, r, capabilities, fields):
    engine = SyntheticEngine()
    engine.capabilities = capabilities
    engine.prefill_tokens_computed, engine.prefill_tokens_cached = 5, 3  # type: ignore[attr-defined]
    ctx = WorkerContext(settings=settings, name="w", engine=engine, redis=r, parts=[settings.keys],
                        stats=WorkerStats(), stopping=asyncio.Event(), block_ms=100)
    liveness = Liveness(ctx, Flights(4, run=lambda *_: asyncio.sleep(0), stopping=ctx.stopping),
                        state=lambda: "running", blocked=dict)
    await liveness.heartbeat()
    beat = json.loads(await r.hget(settings.keys.workers, "w"))
    assert {"tokens_decoded", "prefill_tokens"} & set(beat) == fields
    if "prefill_tokens" in fields:
        assert beat["prefill_tokens"] == {"computed": 5, "cached": 3}


def test_the_demo_decodes_with_a_tokenizer_only_when_one_is_declared():
    from redroll.cli.demo_run import _decode

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    class Engine:
        capabilities = EngineCapabilities(tokenizer=True)
        tokenizer = Tokenizer()

    class Undeclared:
        tokenizer = Tokenizer()

    assert _decode(Engine(), [104, 105]) == "hi"
    assert _decode(Undeclared(), [104, 105]) == "104 105"
