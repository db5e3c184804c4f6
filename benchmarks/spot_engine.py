"""The synthetic engine with a ledger outside the worker, for ``benchmarks/spot.py``.

Each generation appends a line to the ledger file as it starts (the time, its budget, its samples,
its prompt's tokens) and another as it ends (the tokens it made), each line one ``write`` to a file
opened for appending. A worker killed mid-generation writes no end line: the benchmark, which
killed it and knows when, counts what that generation decoded from its start and the engine's
pace (one token every ``token_ms`` per sample), so decoded tokens are counted whether or not a
worker lives to report them. Run as ``redroll worker --engine benchmarks.spot_engine:LedgerEngine
--engine-arg ledger=PATH --engine-arg token_ms=MS --engine-arg slots=N`` (the repository root on
``PYTHONPATH``).
"""

from __future__ import annotations

import asyncio
import os
import time

from redroll.engine_worker.engines.base import EngineOutput
from redroll.engine_worker.engines.synthetic import SyntheticEngine, _prompt_ids
from redroll.shared.types import GenerationRequest


class LedgerEngine(SyntheticEngine):
    def __init__(self, *, ledger: str, gate: str | None = None, **options: object):
        super().__init__(**options)  # type: ignore[arg-type]
        self._ledger = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pid = os.getpid()
        self._gate = gate

    async def start(self) -> None:
        """With ``gate``: a standby. It says it is ready (``<gate>.ready``), then waits until the
        file ``gate`` exists before the worker goes on to claim, so a replacement joins the moment
        the benchmark opens its gate (the process's start-up, Python's imports, is not counted)."""
        if self._gate is not None:
            open(self._gate + ".ready", "w").close()
            while not os.path.exists(self._gate):
                await asyncio.sleep(0.005)
        await super().start()

    def _note(self, line: str) -> None:
        os.write(self._ledger, (line + "\n").encode())

    async def _generate(self, request: GenerationRequest, abort_ev: asyncio.Event, handle: str) -> EngineOutput:
        sp = request.sampling_params
        self._note(f"S {self._pid} {handle} {time.time():.6f} {sp.max_new_tokens} {sp.n} {len(_prompt_ids(request))}")
        output = await super()._generate(request, abort_ev, handle)
        self._note(f"E {self._pid} {handle} {time.time():.6f} {sum(len(s.token_ids) for s in output.samples)}")
        return output

    async def close(self) -> None:
        await super().close()
        os.close(self._ledger)


def decoded_tokens(ledger_text: str, token_ms: float, deaths: dict[int, float]) -> tuple[int, int, int]:
    """(tokens decoded, prompt tokens prefilled, generations) from a ledger: a generation with an end
    line made what it says; one without (its worker killed) made a token every ``token_ms`` per
    sample from its start until its worker's death (``deaths``: pid → unix time), at most its
    budget; one whose worker is still alive is counted up to now."""
    started: dict[tuple[str, str], tuple[float, int, int, int]] = {}
    ended: dict[tuple[str, str], int] = {}
    for line in ledger_text.splitlines():
        parts = line.split()
        if len(parts) == 7 and parts[0] == "S":
            started[(parts[1], parts[2])] = (float(parts[3]), int(parts[4]), int(parts[5]), int(parts[6]))
        elif len(parts) == 5 and parts[0] == "E":
            ended[(parts[1], parts[2])] = int(parts[4])
    decoded = prefilled = 0
    now = time.time()
    for key, (at, budget, n, prompt) in started.items():
        prefilled += prompt
        if key in ended:
            decoded += ended[key]
        else:
            until = deaths.get(int(key[0]), now)
            decoded += n * min(budget, max(0, int((until - at) * 1000.0 / token_ms)))
    return decoded, prefilled, len(started)
