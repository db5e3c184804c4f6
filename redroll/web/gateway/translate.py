"""OpenAI bodies to redroll requests, and records back to OpenAI responses.

One HTTP call is one request per prompt (``n`` samples each: ``sampling_params.n``); a streamed
call (``stream: true``) is one request per choice instead, each one sample (a streamed request
makes one), seeded ``seed + i`` for choice ``i`` when the call gives a seed. A call of several
requests is one group (``group_id``), so its requests share a partition. Responses are built
from the records alone (their ``meta_info`` carries what the call needs), so any replica that holds
the records of a call answers it the same way: a retried call gets the very response.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec

from redroll.producer.request import make_request
from redroll.shared.codec import ValidationError, encode_request
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus
from redroll.web.gateway.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from redroll.web.gateway.protocol import ChatBody, CompletionBody, GatewayError, invalid, response_format_schema
from redroll.web.gateway.sessions import SessionTurn

FIELD_NAMES = {"prompt": "prompt", "input_ids": "prompt", "messages": "messages", "tools": "tools",
               "sampling_params.max_new_tokens": "max_tokens", "sampling_params.n": "n",
               "sampling_params.temperature": "temperature", "sampling_params.top_p": "top_p",
               "sampling_params.top_k": "top_k", "sampling_params.min_p": "min_p",
               "sampling_params.stop": "stop", "sampling_params.stop_token_ids": "stop_token_ids",
               "sampling_params.sampling_seed": "seed", "sampling_params.min_new_tokens": "min_tokens",
               "top_logprobs_num": "top_logprobs", "affinity_key": "session_id", "stream": "stream",
               "sampling_params.repetition_penalty": "repetition_penalty",
               "sampling_params.frequency_penalty": "frequency_penalty",
               "sampling_params.presence_penalty": "presence_penalty", "logprob_start_len": "prompt_logprobs",
               "return_prompt_token_ids": "return_token_ids", "sampling_params.regex": "structured_outputs.regex",
               "sampling_params.json_schema": "structured_outputs.json",
               "sampling_params.ebnf": "structured_outputs.grammar",
               "sampling_params.structural_tag": "structured_outputs.structural_tag", "tool_choice": "tool_choice",
               "tool_choice.function.name": "tool_choice", "prefix_ids": "session_id"}
"""redroll's field names (in a ValidationError) as the OpenAI body names them."""

META = "gateway"
"""The ``meta_info`` key the gateway's facts travel under (echoed back in the record)."""


def session_key(session: str | None) -> str | None:
    """A session id (any text) as an affinity key (a request_id-shaped name): a stable hash."""
    if not session:
        return None
    return "s-" + hashlib.sha256(session.encode()).hexdigest()[:32]


def redroll_priority(priority: int) -> int:
    """vLLM's priority (lower runs earlier, 0 by default) as redroll's: below 0 is high (1), else 0."""
    return 1 if priority < 0 else 0


def structured(body: Any) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` as SGLang's sampling keys (which engines honour or refuse)."""
    so = body.structured_outputs
    if so is None:
        return {}
    out: dict[str, Any] = {}
    if so.regex is not None:
        out["regex"] = so.regex
    if so.json is not None:
        out["json_schema"] = so.json if isinstance(so.json, str) else msgspec.json.encode(so.json).decode()
    if so.grammar is not None:
        out["ebnf"] = so.grammar
    if so.structural_tag is not None:
        out["structural_tag"] = so.structural_tag
    return out


def template_variables(body: ChatBody) -> dict[str, Any] | None:
    """The chat's template variables: its ``chat_template_kwargs`` and, as vLLM passes it,
    ``reasoning_effort`` (with ``enable_thinking`` unless the call sets it)."""
    if body.reasoning_effort is None:
        return body.chat_template_kwargs
    out = {"reasoning_effort": body.reasoning_effort, "enable_thinking": body.reasoning_effort != "none"}
    return {**out, **(body.chat_template_kwargs or {})}


def shared_sampling(source: Any) -> dict[str, Any]:
    """The sampling fields an OpenAI-style body and the sampling parameters of vLLM's generate
    body share, those ``source`` sets, in redroll's names."""
    out: dict[str, Any] = {}
    top_k = -1 if source.top_k == 0 else source.top_k  # (vLLM's 0 and -1 are both "off"; redroll's off is -1)
    for ours, theirs in (("temperature", source.temperature), ("top_p", source.top_p), ("top_k", top_k),
                         ("min_p", source.min_p), ("repetition_penalty", source.repetition_penalty),
                         ("frequency_penalty", source.frequency_penalty),
                         ("presence_penalty", source.presence_penalty), ("sampling_seed", source.seed)):
        if theirs is not None:
            out[ours] = theirs
    if source.stop:
        out["stop"] = [source.stop] if isinstance(source.stop, str) else list(source.stop)
    if source.stop_token_ids:
        out["stop_token_ids"] = list(source.stop_token_ids)
    return out


def build_requests(body: CompletionBody | ChatBody, *, base_id: str, session: str | None,
                   settings: Settings, fingerprint: str, model: str | None = None,
                   turn: SessionTurn | None = None) -> list[GenerationRequest]:
    """The requests of one call (checked against the wire contract; a break is a 400 naming the
    OpenAI field). ``base_id`` names the call: its requests are ``<base_id>-<i>``, ``i`` the
    prompt's index, or (streamed) the choice's: ``n`` choices of each prompt, in order. ``model``:
    the name the response gives (the call's ``model`` when None). ``turn``: the session turn of
    a chat (its ``prefix_ids`` and new messages; its ids come back in the response)."""
    facts_extra: dict[str, Any] = {}
    sampling: dict[str, Any] = {"n": body.n, "ignore_eos": body.ignore_eos, "min_new_tokens": body.min_tokens,
                                "skip_special_tokens": body.skip_special_tokens, **structured(body)}
    sampling.update(shared_sampling(body))
    if isinstance(body, ChatBody):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise invalid("top_logprobs", "needs logprobs=true")
        want_logprobs = bool(body.logprobs)
        fmt = response_format_schema(body)
        if fmt is not None:
            facts_extra["rf"] = True
            if "json_schema" in sampling:
                raise invalid("response_format", "not with structured_outputs.json (one schema per call)")
            sampling["json_schema"] = fmt
        chat: dict[str, Any] = {"messages": body.messages, "tools": body.tools, "chat_template": body.chat_template,
                                "chat_template_kwargs": template_variables(body)}
        if turn is not None and turn.prefix_ids is not None:
            chat.update(messages=turn.new_messages, prefix_ids=turn.prefix_ids)
        if body.tools and body.tool_choice is not None:
            chat["tool_choice"] = body.tool_choice
        if body.tools and body.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = body.parallel_tool_calls
        inputs: list[dict[str, Any]] = [chat]
    else:
        max_tokens = body.max_tokens
        top = body.logprobs or 0
        want_logprobs = body.logprobs is not None
        inputs = [{"prompt": p} if isinstance(p, str) else {"input_ids": p} for p in _prompts(body.prompt)]
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    with_prompt_logprobs = body.prompt_logprobs is not None
    facts: dict[str, Any] = {"created": int(time.time()), "model": model or body.model, "fp": fingerprint,
                             "ids": bool(body.return_token_ids) or turn is not None, **facts_extra}
    if isinstance(body, ChatBody) and body.tools and body.tool_choice != "none":
        facts["tc"] = "named" if isinstance(body.tool_choice, dict) else body.tool_choice or "auto"
    if with_prompt_logprobs:  # (the record then has output logprobs the call did not ask for: say which)
        facts.update(lp=want_logprobs, plp=True)
    meta = {META: facts}
    ask_prompt_ids = bool(body.return_token_ids) or with_prompt_logprobs or turn is not None
    streamed = bool(body.stream)
    samples = body.n if streamed else 1
    group_id = base_id if len(inputs) * samples > 1 else None
    requests = []
    try:
        for prompt in inputs:
            for _ in range(samples):
                i = len(requests)
                params = sampling
                extra: dict[str, Any] = {}
                if streamed:
                    params = {**sampling, "n": 1}
                    if body.seed is not None:
                        params["sampling_seed"] = body.seed + i
                    extra["stream"] = True
                if ask_prompt_ids and "input_ids" not in prompt:  # (ids sent are echoed by the gateway)
                    extra["return_prompt_token_ids"] = True
                if with_prompt_logprobs:
                    extra["logprob_start_len"] = 0
                req = make_request(request_id=f"{base_id}-{i}", sampling_params=params, return_text=True,
                                   return_logprob=want_logprobs or with_prompt_logprobs, top_logprobs_num=top,
                                   meta_info=meta, affinity_key=session_key(session), group_id=group_id,
                                   priority=redroll_priority(body.priority),
                                   min_weight_version=body.min_weight_version, **prompt, **extra)
                req.reply_to = settings.keys_for(req).results  # (checked here; the sender sets its own)
                encode_request(req, settings.limits)
                requests.append(req)
    except ValidationError as exc:
        param = FIELD_NAMES.get(exc.field, exc.field)
        if param == "max_tokens" and isinstance(body, ChatBody) and body.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise GatewayError(400, f"invalid {param}: {exc.rule}", param=param, code="invalid_value") from None
    return requests


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _prompts(prompt: Any) -> list[Any]:
    """The call's prompts: a text, a list of texts, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "must not be empty")
    if _is_ids(prompt):
        return [prompt]
    for i, p in enumerate(prompt):
        if not (isinstance(p, str) or _is_ids(p)):
            raise invalid(f"prompt[{i}]", "a prompt is a text, or a non-empty list of token ids (integers >= 0)")
    return list(prompt)


# ---------------------------------------------------------------- responses

def check_records(records: list[CompletionRecord], names: dict[str, str] = FIELD_NAMES) -> None:
    """A call whose records are not all finished answers with the first failure, in OpenAI's shape:
    a request a worker refused (``invalid <field>: ...``) is a 400 naming the field (as ``names``
    renames redroll's fields: the OpenAI body's by default)."""
    for rec in records:
        if rec.status is RecordStatus.FINISHED:
            continue
        message = rec.error or f"the request ended {rec.status.value}"
        if rec.status is RecordStatus.ERROR and message.startswith("invalid "):
            field, _, rule = message[len("invalid "):].partition(":")
            param = names.get(field, field)
            if field == "sampling_params.json_schema" and gateway_meta(rec).get("rf"):
                param = "response_format"  # (the call's schema came from its response_format)
            raise GatewayError(400, f"invalid {param}:{rule}", param=param, code="invalid_value")
        raise GatewayError(500 if rec.status is RecordStatus.ERROR else 503, message, kind="server_error",
                           code=rec.status.value)


def _usage(records: list[CompletionRecord]) -> dict[str, int]:
    prompt = sum(int(rec.meta_info.get("prompt_tokens") or 0) for rec in records)
    completion = sum(len(ids) for rec in records for ids in rec.output_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _samples(records: list[CompletionRecord]):
    """(choice index, prompt index, record, sample index) over a call's records, in order."""
    index = 0
    for k, rec in enumerate(records):
        for j in range(len(rec.output_token_ids)):
            yield index, k, rec, j
            index += 1


def choice_extensions(rec: CompletionRecord, j: int, with_ids: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"weight_version": rec.meta_info.get("weight_version")}
    if rec.weight_versions and rec.weight_versions[j] is not None:
        out["weight_versions"] = rec.weight_versions[j]
    if with_ids:
        out["token_ids"] = rec.output_token_ids[j]
    return out


def gateway_meta(rec: CompletionRecord) -> dict[str, Any]:
    return rec.meta_info.get(META) or {}


def prompt_token_ids(body: CompletionBody | ChatBody) -> list[list[int] | None]:
    """Each prompt's token ids where the call sent ids (text and chats: null here, the worker's
    rendering comes in the record, :func:`prompt_of`)."""
    if isinstance(body, ChatBody):
        return [None]
    return [p if not isinstance(p, str) else None for p in _prompts(body.prompt)]


def prompt_of(sent: list[int] | None, rec: CompletionRecord | None) -> list[int] | None:
    """A prompt's token ids: as the call sent them, else as the worker ran them (its record)."""
    if sent is not None:
        return sent
    return rec.prompt_token_ids if rec is not None else None


def _shows_logprobs(rec: CompletionRecord) -> bool:
    """Whether the call asked for output logprobs (a call with prompt logprobs says so in its facts)."""
    return bool(gateway_meta(rec).get("lp", True)) and rec.output_logprobs is not None


def _prompt_logprobs_of(sent: list[int] | None, rec: CompletionRecord) -> list[dict[str, Any] | None] | None:
    if not gateway_meta(rec).get("plp"):
        return None
    return prompt_logprobs(prompt_of(sent, rec), rec.input_logprobs)


def _tops_of(rec: CompletionRecord, j: int) -> Any:
    return rec.output_top_logprobs[j] if rec.output_top_logprobs else None


def sample_calls(rec: CompletionRecord, j: int) -> Any:
    """The parsed tool calls of sample ``j`` (None when it made none)."""
    return rec.tool_calls[j] if rec.tool_calls else None


def assistant_message(rec: CompletionRecord, j: int) -> dict[str, Any]:
    """A sample as OpenAI's assistant message: its text, or (a sample that called tools) the text
    outside its calls and the calls, as the worker's parser read them."""
    text = (rec.output_text or [""] * (j + 1))[j]
    calls = sample_calls(rec, j)
    if calls is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": calls.content,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls.calls]}


def chat_finish_reason(rec: CompletionRecord, j: int) -> str | None:
    """OpenAI's rule, as vLLM applies it: ``tool_calls`` for a sample that called tools under an
    ``auto`` or ``required`` choice, ``stop`` under a named one."""
    reason = rec.finish_reasons[j]
    if reason == "stop" and sample_calls(rec, j) is not None and gateway_meta(rec).get("tc") in ("auto", "required"):
        return "tool_calls"
    return reason


def completion_response(call_id: str, model: str, records: list[CompletionRecord],
                        prompts: list[list[int] | None], top: int = 0) -> dict[str, Any]:
    """A ``text_completion`` object from a call's records (one per prompt, in order); ``top``: the
    call's ``logprobs``."""
    check_records(records)
    meta = gateway_meta(records[0])
    with_ids = bool(meta.get("ids"))
    choices = []
    for index, k, rec, j in _samples(records):
        choice: dict[str, Any] = {"index": index, "text": (rec.output_text or [""] * (j + 1))[j],
                                  "finish_reason": rec.finish_reasons[j], "stop_reason": None,
                                  "logprobs": None}
        if _shows_logprobs(rec):
            choice["logprobs"] = completion_logprobs(rec.output_token_ids[j], rec.output_logprobs[j],  # type: ignore[index]
                                                     _tops_of(rec, j), top)
        choice.update(choice_extensions(rec, j, with_ids))
        if with_ids:
            choice["prompt_token_ids"] = prompt_of(prompts[k], rec)
        plp = _prompt_logprobs_of(prompts[k], rec)
        if plp is not None:
            choice["prompt_logprobs"] = plp
        choices.append(choice)
    return {"id": f"cmpl-{call_id}", "object": "text_completion", "created": meta.get("created", int(time.time())),
            "model": meta.get("model") or model, "choices": choices, "usage": _usage(records),
            "weight_version": records[0].meta_info.get("weight_version")}


def chat_response(call_id: str, model: str, records: list[CompletionRecord],
                  prompts: list[list[int] | None], top: int = 0) -> dict[str, Any]:
    """A ``chat.completion`` object from a call's record; ``top``: the call's ``top_logprobs``."""
    check_records(records)
    meta = gateway_meta(records[0])
    with_ids = bool(meta.get("ids"))
    choices = []
    for index, k, rec, j in _samples(records):
        choice: dict[str, Any] = {
            "index": index, "message": assistant_message(rec, j),
            "finish_reason": chat_finish_reason(rec, j), "stop_reason": None, "logprobs": None}
        if _shows_logprobs(rec):
            choice["logprobs"] = chat_logprobs(rec.output_token_ids[j], rec.output_logprobs[j],  # type: ignore[index]
                                               _tops_of(rec, j), top)
        choice.update(choice_extensions(rec, j, with_ids))
        choices.append(choice)
    response = {"id": f"chatcmpl-{call_id}", "object": "chat.completion",
                "created": meta.get("created", int(time.time())), "model": meta.get("model") or model,
                "choices": choices, "usage": _usage(records),
                "weight_version": records[0].meta_info.get("weight_version")}
    if with_ids:
        response["prompt_token_ids"] = prompt_of(prompts[0], records[0])
    plp = _prompt_logprobs_of(prompts[0], records[0])
    if plp is not None:
        response["prompt_logprobs"] = plp
    return response
