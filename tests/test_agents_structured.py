"""Structured output on the transformers engine (llguidance): with a bounded strict JSON schema,
50 sampled completions of a random-weight model all parse, validate and end with ``stop``; without
it, none does (the grammar did it). The record's logprobs stay the model's (a teacher-forced pass
without the grammar recomputes them). A continuation advances the grammar over the saved tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from redroll.engine_worker.engines.grammar import mark_continued  # noqa: E402
from redroll.engine_worker.engines.tiny_model import teacher_forced_logprobs  # noqa: E402
from redroll.engine_worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from redroll.shared.codec import ValidationError  # noqa: E402
from redroll.shared.continuing import continue_after  # noqa: E402
from redroll.shared.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.agents_support import CARD_SCHEMA, valid_card  # noqa: E402
from tests.conftest import started  # noqa: E402

PROMPT = [10, 20, 30, 40]


def request(i: int, schema: dict | None, **sampling) -> GenerationRequest:
    extra = {"json_schema": json.dumps(schema)} if schema is not None else {}
    return GenerationRequest(request_id=f"s{i}", input_ids=PROMPT, return_text=True, return_logprob=True,
                             sampling_params=SamplingParams(max_new_tokens=160, sampling_seed=i, **extra, **sampling))


async def test_fifty_completions_under_a_schema_all_validate_and_without_it_none_do():
    async with started(TransformersEngine("tiny-random")) as engine:
        outputs = await asyncio.gather(*[engine.generate(request(i, CARD_SCHEMA), f"c{i}") for i in range(50)],
                                       *[engine.generate(request(i, None), f"f{i}") for i in range(50)])
        constrained = [o.samples[0] for o in outputs[:50]]
        free = [o.samples[0] for o in outputs[50:]]
        assert all(s.finish_reason == "stop" and valid_card(s.text) for s in constrained), \
            [(s.finish_reason, s.text) for s in constrained if not valid_card(s.text)]
        assert sum(valid_card(s.text) for s in free) == 0
        # the logprobs are the model's own: teacher forcing without the grammar gives them back
        sample = constrained[0]
        forced = teacher_forced_logprobs(engine._model, PROMPT, sample.token_ids, 1.0)
        assert forced == pytest.approx(sample.logprobs, abs=1e-4)


async def test_a_continuation_advances_the_grammar_over_the_saved_tokens():
    async with started(TransformersEngine("tiny-random")) as engine:
        whole = await engine.generate(request(7, CARD_SCHEMA, temperature=0.0), "w")
        ids = whole.samples[0].token_ids
        original = request(7, CARD_SCHEMA, temperature=0.0)
        for cut in (1, len(ids) // 2, len(ids) - 2):
            continued = mark_continued(continue_after(original, ids[:cut]), original, cut)
            rest = (await engine.generate(continued, f"r{cut}")).samples[0]
            joined = engine.tokenizer.decode(ids[:cut] + rest.token_ids)
            assert valid_card(joined) and ids[:cut] + rest.token_ids == ids, cut  # (greedy: the same tokens)
        # saved tokens the grammar refuses: the continuation is refused, naming the grammar's field
        bad = mark_continued(continue_after(original, [ord("x")]), original, 1)
        with pytest.raises(ValidationError) as err:
            await engine.generate(bad, "bad")
        assert err.value.field == "sampling_params.json_schema"


async def test_grammars_llguidance_cannot_build_are_refused_naming_the_field():
    async with started(TransformersEngine("tiny-random")) as engine:
        for sampling, field in (({"json_schema": "{not json"}, "sampling_params.json_schema"),
                                ({"regex": "(unclosed"}, "sampling_params.regex"),
                                ({"regex": "a", "json_schema": "{}"}, "sampling_params.regex")):
            req = GenerationRequest(request_id="x", input_ids=PROMPT, sampling_params=SamplingParams(**sampling))
            with pytest.raises(ValidationError) as err:
                engine.validate(req)
            assert err.value.field == field, (sampling, err.value)
