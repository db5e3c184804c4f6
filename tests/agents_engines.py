"""Engines for the continuation tests of structured requests (tests/test_agents_resume.py), as a
worker process runs them: ``redroll worker --engine tests.agents_engines:StepDelayed``."""

from __future__ import annotations

import dataclasses
import time

from redroll.engine_worker.engines.transformers_engine import TransformersEngine


class StepDelayed(TransformersEngine):
    """The transformers engine, each decoding step ``step_ms`` longer (in its worker thread): a
    generation long enough to be stopped after its first checkpoint, whatever the machine's speed
    (``--engine-arg step_ms=N``)."""

    def __init__(self, model_path: str = "tiny-random", *, step_ms: float = 100.0, **kw):
        super().__init__(model_path, **kw)
        self.step_s = float(step_ms) / 1000.0

    def _decode_step(self, *args, **kwargs):
        time.sleep(self.step_s)
        return super()._decode_step(*args, **kwargs)


class NoGrammarResume(TransformersEngine):
    """The transformers engine without ``grammar_resume``: a worker treats its structured
    continuations as it treats vLLM's (started over from the prompt)."""

    capabilities = dataclasses.replace(TransformersEngine.capabilities, grammar_resume=False)
