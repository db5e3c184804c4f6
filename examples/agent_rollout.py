"""An agent rollout through the door: a multi-turn, tool-using episode driven with the official
``openai`` SDK against ``redroll serve``, recorded as a trainer takes it.

The environment is a calculator (``add``, ``mul``). The agent is asked "What is (2+3)*4?"; each
turn the model either calls a tool (parsed into OpenAI ``tool_calls`` by the worker's
``--tool-call-parser hermes``) or answers. The episode runs in one session (``X-Session-Id``), so
every turn's prompt is token for token the previous prompt + the model's completion + the tool's
result as the chat template renders it: the episode is one token sequence whose model tokens are
exactly the ones the model produced. Each turn's ids and logprobs come back in the response
(``prompt_token_ids``, ``token_ids``, ``logprobs``); the episode is written as verl's agent loop
writes one (``prompt_ids``, ``response_ids``, ``response_mask``: 1 on model tokens, 0 on tool and
environment tokens, ``response_logprobs``: 0 where the mask is), with the turns beside it.

    python examples/agent_rollout.py --out episodes.jsonl       # a demo stack on this machine
    python examples/agent_rollout.py --base-url http://gw:8000/v1 --model my-agent --out episodes.jsonl

Without ``--base-url`` it runs a demo stack in this process: a Redis (``REDROLL_REDIS_URL`` or a
private redis-server), a transformers worker on a tiny Hermes-format checkpoint whose output layer
was fitted to play this episode (``engine_worker/engines/tiny_agent.py``: a tiny model never calls
tools on its own; this one says the calls through the real template, engine and parser), and the
gateway on a free port of localhost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": name, "description": f"a {symbol} b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}} for name, symbol in (("add", "+"), ("mul", "*"))]
QUESTION = "What is (2+3)*4?"
ANSWER = "(2+3)*4 = 20."


def calculator(name: str, arguments: str) -> str:
    """The environment: one tool call's result (an error is a result too: the model reads it)."""
    try:
        args = json.loads(arguments)
        value = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}[name](int(args["a"]), int(args["b"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
    return str(value)


async def episode(client: openai.AsyncOpenAI, model: str, max_turns: int = 6) -> dict[str, Any]:
    """One episode: turns until the model answers without a call (or ``max_turns``)."""
    session = f"episode-{uuid.uuid4().hex[:12]}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    turns = []
    for _ in range(max_turns):
        out = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=0.0, max_tokens=64, logprobs=True,
            extra_headers={"X-Session-Id": session})
        choice = out.choices[0]
        calls = choice.message.tool_calls or []
        turns.append({"prompt_ids": out.model_extra["prompt_token_ids"], "completion_ids": choice.model_extra["token_ids"],
                      "logprobs": [t.logprob for t in choice.logprobs.content],
                      "finish_reason": choice.finish_reason, "content": choice.message.content,
                      "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]})
        messages.append(choice.message.model_dump(exclude_none=True))
        if not calls:
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(call.function.name, call.function.arguments)})
    return trainer_row(turns)


def trainer_row(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The episode as one sequence (the last turn's prompt + completion): the first prompt, then the
    response with its loss mask and logprobs. Every turn's prompt and completion sit at their
    place in it, token for token (the session made each prompt extend the one before)."""
    last = turns[-1]
    sequence = last["prompt_ids"] + last["completion_ids"]
    first = len(turns[0]["prompt_ids"])
    mask, logprobs = [0] * len(sequence), [0.0] * len(sequence)
    for turn in turns:
        start, ids = len(turn["prompt_ids"]), turn["completion_ids"]
        if sequence[:start] != turn["prompt_ids"] or sequence[start:start + len(ids)] != ids:
            raise AssertionError("a turn's prompt does not extend the one before: the session was not token-exact")
        if len(turn["logprobs"]) != len(ids):
            raise AssertionError(f"{len(turn['logprobs'])} logprobs for {len(ids)} tokens")
        mask[start:start + len(ids)] = [1] * len(ids)
        logprobs[start:start + len(ids)] = turn["logprobs"]
    answer = turns[-1]["content"] or ""
    return {"prompt_ids": sequence[:first], "response_ids": sequence[first:], "response_mask": mask[first:],
            "response_logprobs": logprobs[first:], "reward": float("20" in answer and not turns[-1]["tool_calls"]),
            "num_turns": len(turns), "turns": turns}


def show(row: dict[str, Any]) -> None:
    """Each turn's part of the response: the tool's result and the template around it (mask 0),
    then the model's tokens (mask 1) with their logprobs."""
    offset = len(row["prompt_ids"])
    print(f"episode: {row['num_turns']} turns; prompt {offset} tokens; response {len(row['response_ids'])} tokens "
          f"({sum(row['response_mask'])} model, {row['response_mask'].count(0)} tool/environment); "
          f"reward {row['reward']}")
    end = 0
    for k, turn in enumerate(row["turns"]):
        begin, start = end, len(turn["prompt_ids"]) - offset
        end = start + len(turn["completion_ids"])
        said = turn["tool_calls"] or repr(turn["content"])
        print(f"  turn {k + 1}: mask {''.join(map(str, row['response_mask'][begin:end]))}  -> {said}")
        print(f"          logprobs {[round(x, 3) for x in turn['logprobs']]}")


# ---------------------------------------------------------------- the demo stack

SCRIPT_CALLS = [("add", {"a": 2, "b": 3}, "5"), ("mul", {"a": 5, "b": 4}, "20")]


def scripted_episode() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]], str]]:
    """(conversation, tools, the model's reply) per turn of the demo episode, for the tiny model to learn."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    script = []
    for i, (name, args, result) in enumerate(SCRIPT_CALLS):
        script.append((list(messages), TOOLS,
                       f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'))
        call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": result}]
    script.append((list(messages), TOOLS, ANSWER))
    return script


@contextlib.asynccontextmanager
async def demo_stack(model: str) -> AsyncIterator[str]:
    """Redis, a worker on the scripted checkpoint and the gateway, in this process; yields its URL."""
    import uvicorn

    from redroll.cli.options import listening_socket
    from redroll.engine_worker.engines.tiny_agent import save_agent_checkpoint
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine
    from redroll.engine_worker.worker import Worker
    from redroll.shared.settings import Settings
    from redroll.testing.embedded import embedded_redis
    from redroll.web.gateway.app import GatewayConfig, build_app

    with embedded_redis() as (url, _), tempfile.TemporaryDirectory() as tmp:
        settings = Settings(redis_url=url, namespace="agent-" + uuid.uuid4().hex[:8])
        checkpoint = save_agent_checkpoint(Path(tmp) / "calculator", "hermes", scripted=scripted_episode())
        worker = Worker(settings, TransformersEngine(str(checkpoint), tool_call_parser="hermes"), block_ms=100)
        sock = listening_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(build_app(settings, GatewayConfig(model_name=model)),
                                               log_level="warning", access_log=False))
        tasks = [asyncio.create_task(worker.run()), asyncio.create_task(server.serve(sockets=[sock]))]
        try:
            while not server.started:
                await asyncio.sleep(0.05)
            yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        finally:
            server.should_exit = True
            worker.request_stop()
            await asyncio.gather(*tasks)


async def main(args: argparse.Namespace) -> int:
    async with contextlib.AsyncExitStack() as stack:
        base_url = args.base_url or await stack.enter_async_context(demo_stack(args.model))
        client = openai.AsyncOpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=120)
        stack.push_async_callback(client.close)
        rows = [await episode(client, args.model) for _ in range(args.episodes)]
    with open(args.out, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    for row in rows:
        show(row)
    return 0 if all(row["reward"] == 1.0 for row in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an OpenAI-compatible base URL (redroll serve's /v1); default: a demo stack")
    parser.add_argument("--model", default="calculator-agent", help="the model name to call")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=1)
    parser.add_argument("--out", default="episodes.jsonl", help="where the episodes go (JSON lines)")
    sys.exit(asyncio.run(main(parser.parse_args())))
