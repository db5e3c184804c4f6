"""Fleet control over HTTP, for orchestrators that drive their inference servers (prime-rl's,
SkyRL's and TRL's clients of vLLM's RL endpoints): pause, load new weights, resume.

* ``POST /pause?mode=keep&clear_cache=false``: the fleet stops claiming (queued requests wait);
  ``mode`` (vLLM's, ``abort`` by default) says what becomes of what runs: ``keep`` lets it run on,
  ``wait`` answers once it finished, ``abort`` aborts it. Answers once every live worker is paused.
* ``POST /update_weights {"weight_dir": path}``: the fleet's desired weights become that
  checkpoint, at the version :func:`version_for` gives; answers once every live worker serves it.
  While paused with ``keep`` (or not paused) the workers swap in place, between two decode steps
  of what runs; paused with ``wait`` or ``abort`` nothing runs, so they just load.
* ``POST /resume``, ``GET /is_paused``.

They act on the policy's fleet (the first model), through the control stream and ``{ns}:weights``
(late joiners load the weights and start paused). They need the gateway's bearer keys: a gateway
without ``--api-key-file`` refuses them. vLLM's weight-transfer endpoints (NCCL, CUDA IPC, NIXL)
and the rest of its dev-mode routes are refused by name (:data:`REFUSED`).
"""

from __future__ import annotations

import re
import time
from pathlib import PurePath
from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from redroll.ops.control import (
    CONTROL_MAXLEN,
    fleet_paused,
    live_workers,
    pause_fleet,
    resume_fleet,
    wait_for_workers,
)
from redroll.shared.commands import UpdateWeights, command_fields
from redroll.web.gateway.protocol import GatewayError, decode_body, invalid

PAUSE_MODES = ("keep", "wait", "abort")
UPDATE_MODE_WHEN_PAUSED = {None: "in_place", "keep": "in_place", "wait": "quiesce", "abort": "abort"}
"""How workers take new weights, by how the fleet is paused: under running requests when they run
on (vLLM's ``keep``), plainly when nothing runs."""

NO_BROADCAST = ("redroll takes no NCCL, NIXL or CUDA-IPC weight transfer over HTTP: write the weights to a "
                "directory its workers can read and send {\"weight_dir\": path} to /update_weights, or push "
                "them from the trainer with Producer.weight_sync")

_TRANSFER = "vLLM's weight-transfer engine (NCCL or CUDA IPC between trainer and server): " + NO_BROADCAST
_LORA = "LoRA adapters loaded at run time are not supported (serve a merged checkpoint through /update_weights)"
REFUSED = {
    "/init_weight_transfer_engine": _TRANSFER,
    "/shutdown_weight_transfer_engine": _TRANSFER,
    "/start_weight_update": _TRANSFER,
    "/finish_weight_update": _TRANSFER,
    "/start_draft_weight_update": _TRANSFER,
    "/update_weight_version": _TRANSFER,
    "/collective_rpc": "calls into vLLM's worker processes (SkyRL's NCCL and CUDA-IPC weight updates): "
                       + NO_BROADCAST,
    "/get_world_size": "the world size of vLLM's NCCL weight-transfer group: " + NO_BROADCAST,
    "/init_broadcaster": "prime-rl's NCCL and NIXL weight broadcast: " + NO_BROADCAST,
    "/fetch_weights": "SkyRL's delta (XOR) checkpoints are not read: send a full checkpoint's directory to "
                      "/update_weights",
    "/server_info": "vLLM's engine configuration (read for its own weight transfer): " + NO_BROADCAST,
    "/reset_prefix_cache": "no reset on request: redroll's workers drop or salt their prefix caches whenever "
                           "their weights change",
    "/sleep": "GPU memory is released with redroll weights release / resume (for a colocated trainer)",
    "/wake_up": "GPU memory is released with redroll weights release / resume (for a colocated trainer)",
    "/load_lora_adapter": _LORA,
    "/v1/load_lora_adapter": _LORA,
    "/v1/unload_lora_adapter": _LORA,
    "/skyrl/v1/load_lora_adapter": _LORA,
    "/skyrl/v1/generate": "SkyRL's generate with routed experts: use /inference/v1/generate",
}
"""vLLM's (and its RL clients') server routes that redroll does not serve, each refused (501) saying why."""

_STEP = re.compile(r"^step[_-]?(\d+)$")


class UpdateWeightsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /update_weights``: prime-rl's ``{"weight_dir": path}``, plus redroll's optional
    ``weight_version``; vLLM's ``update_info`` (its weight-transfer engine) is refused by name."""

    weight_dir: Union[Annotated[str, Meta(min_length=1, max_length=4096)], None, UnsetType] = UNSET
    weight_version: Optional[Annotated[int, Meta(ge=0)]] = None
    update_info: Any = UNSET


def version_for(weight_dir: str, explicit: int | None, desired: str | None) -> str:
    """The weight version a ``weight_dir`` update sets: ``weight_version`` when the call gives one;
    else the step ``N`` of the path's last ``step_N`` part (prime-rl's ``broadcasts/step_12``,
    ``checkpoints/step_12/weight``: records then name the trainer's step); else the desired
    version + 1 (an integer that only grows, so ``min_weight_version`` keeps its order)."""
    if explicit is not None:
        return str(explicit)
    for part in reversed(PurePath(weight_dir).parts):
        found = _STEP.match(part)
        if found:
            return str(int(found.group(1)))
    try:
        return str(int(desired or "") + 1)
    except ValueError:
        return "1"


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise invalid(name, f"must be true or false, got {raw!r}")


def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    for name in request.query_params:
        if name not in allowed:
            raise invalid(name, "unknown query parameter: this endpoint takes " +
                          (", ".join(allowed) if allowed else "none"))
    return dict(request.query_params)


async def _no_body(request: Request) -> None:
    raw = (await request.body()).strip()
    if raw and raw not in (b"{}", b"null"):
        raise invalid("body", "this endpoint takes no body")


class Fleet:
    """The control endpoints of one gateway (acting on its policy's fleet): ``gateway`` is the
    :class:`redroll.web.gateway.app.Gateway` (not imported: it imports this module)."""

    def __init__(self, gateway: Any):
        self.gateway = gateway

    @property
    def _pipeline(self) -> Any:
        return self.gateway.pipelines.policy

    def _timeout(self) -> float:
        return self.gateway.config.control_timeout_s

    def _check_workers(self, what: str, failed: dict[str, str], behind: list[str]) -> None:
        if failed:
            worker, error = sorted(failed.items())[0]
            raise GatewayError(500, f"{what}: worker {worker} failed: {error}" +
                               (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""), kind="server_error",
                               code="worker_failed")
        if behind:
            raise GatewayError(504, f"{what}: workers not there after {self._timeout():.0f} s: {', '.join(behind)}",
                               kind="timeout", code="timeout")

    async def pause(self, request: Request) -> dict[str, Any]:
        query = _query(request, ("mode", "clear_cache"))
        await _no_body(request)
        mode = query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise invalid("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        clear = _flag("clear_cache", query.get("clear_cache", "true"))
        if clear and mode != "keep":  # (vLLM itself ignores clear_cache with keep)
            raise invalid("clear_cache", "must be false: redroll's workers keep their prefix caches through a pause "
                                         "(they drop or salt them whenever their weights change)")
        p = self._pipeline
        r = p.producer.redis
        sent = await pause_fleet(r, p.settings.keys, mode)  # type: ignore[arg-type]
        done, failed, behind = await wait_for_workers(r, p.settings.keys, "pause", sent,
                                                      lambda beat: beat.get("state") == "paused",
                                                      timeout=self._timeout())
        self._check_workers("pause", failed, behind)
        return {"status": "paused", "mode": mode, "workers": done}

    async def resume(self, request: Request) -> dict[str, Any]:
        _query(request, ())
        await _no_body(request)
        p = self._pipeline
        r = p.producer.redis
        sent = await resume_fleet(r, p.settings.keys)
        done, failed, behind = await wait_for_workers(r, p.settings.keys, "resume", sent,
                                                      lambda beat: beat.get("state") not in ("paused", "pausing"),
                                                      timeout=self._timeout())
        self._check_workers("resume", failed, behind)
        return {"status": "resumed", "workers": done}

    async def is_paused(self, request: Request) -> dict[str, Any]:
        _query(request, ())
        p = self._pipeline
        mode = await fleet_paused(p.producer.redis, p.settings.keys)
        workers = await live_workers(p.producer.redis, p.settings.keys)
        return {"is_paused": mode is not None, "mode": mode,
                "workers": {name: beat.get("state") for name, beat in sorted(workers.items())}}

    async def update_weights(self, request: Request) -> dict[str, Any]:
        _query(request, ())
        body = decode_body(await request.body(), UpdateWeightsBody)
        if body.update_info is not UNSET:
            raise invalid("update_info", NO_BROADCAST)
        if body.weight_dir is UNSET:
            raise invalid("weight_dir", "is required: the directory of the new weights, as the workers see it")
        if body.weight_dir is None:
            raise invalid("weight_dir", "null asks for weights sent over NCCL or NIXL; " + NO_BROADCAST)
        p = self._pipeline
        r, keys = p.producer.redis, p.settings.keys
        desired = {k.decode(): v.decode() for k, v in (await r.hgetall(keys.weights)).items()}
        current = desired.get("weight_version")
        paused = desired.get("paused", "").split(" ", 1)[0] or None
        version = version_for(body.weight_dir, body.weight_version, current)
        mode = UPDATE_MODE_WHEN_PAUSED.get(paused, "in_place")
        async with r.pipeline(transaction=True) as pipe:  # (as ops.control.update_weights: desired, then broadcast)
            pipe.hset(keys.weights, mapping={"model_path": body.weight_dir, "weight_version": version,
                                             "updated_at": str(time.time())})
            pipe.xadd(keys.control, command_fields(UpdateWeights(model_path=body.weight_dir, weight_version=version,
                                                                 mode=mode)),  # type: ignore[arg-type]
                      maxlen=CONTROL_MAXLEN, approximate=True)
            _, entry = await pipe.execute()
        sent = entry.decode() if isinstance(entry, bytes) else entry
        done, failed, behind = await wait_for_workers(r, keys, "update_weights", sent,
                                                      lambda beat: beat.get("weight_version") == version,
                                                      timeout=self._timeout())
        self._check_workers(f"update_weights to {body.weight_dir} (version {version})", failed, behind)
        return {"status": "ok", "weight_dir": body.weight_dir, "weight_version": version, "mode": mode,
                "workers": done}

    def routes(self, respond: Any) -> list[Route]:
        """The endpoints, each answered through ``respond(request, name, handler)`` (auth, errors,
        metrics), and the refused ones."""
        def control(name: str, handler: Any) -> Any:
            async def handle(request: Request) -> Response:
                async def authorized(req: Request) -> Any:
                    self.gateway.authorize_control(req)
                    if not self.gateway.redis_ok:
                        raise GatewayError(503, "Redis is unreachable; retry later", kind="server_error",
                                           code="unavailable", headers={"Retry-After": "1"})
                    return await handler(req)
                return await respond(request, name, authorized)
            return handle

        def refused(path: str, what: str) -> Any:
            async def handle(request: Request) -> Response:
                async def refuse(req: Request) -> Any:
                    self.gateway.authorize(req)
                    raise GatewayError(501, f"{req.method} {path}: not served by redroll: {what}",
                                       kind="not_implemented", code="not_implemented")
                return await respond(request, "refused", refuse)
            return handle

        return [
            Route("/pause", control("pause", self.pause), methods=["POST"]),
            Route("/resume", control("resume", self.resume), methods=["POST"]),
            Route("/is_paused", control("is_paused", self.is_paused), methods=["GET"]),
            Route("/update_weights", control("update_weights", self.update_weights), methods=["POST"]),
            *(Route(path, refused(path, what), methods=["GET", "POST"]) for path, what in REFUSED.items()),
        ]


__all__ = ["Fleet", "REFUSED", "UpdateWeightsBody", "version_for"]
