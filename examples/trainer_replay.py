"""Replay an RL trainer's HTTP calls against ``redroll serve``: the requests prime-rl's orchestrator,
SkyRL's remote inference client or a verl agent loop sends to its vLLM server, copied from their
sources (``examples/replays/<client>.json``: each step names the file and lines it was copied from,
at the pinned commit), and the fields each client reads back.

    python examples/trainer_replay.py prime-rl --base-url http://127.0.0.1:8000 --api-key KEY \\
        --model tiny-policy --weight-dir /ckpt/broadcasts/step_7 --prompt-ids 4 37 45 53 1 5

Each step says what the client expects: a status (``2xx``; or ``refused``, a 4xx or 5xx whose
message names the endpoint or field, where redroll refuses what the client sends), and the response fields the client reads (``choices.0.token_ids``;
``*`` walks every element of a list). Prints one line per step and exits 1 when a step did not
answer as the client needs. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPLAYS = Path(__file__).resolve().parent / "replays"
CLIENTS = ("prime-rl", "skyrl", "verl")


def load(client: str, values: dict[str, Any]) -> dict[str, Any]:
    """The replay file with ``"{name}"`` placeholders replaced by ``values`` (a whole-string
    placeholder takes the value's own type: a list of ids stays a list)."""
    def fill(node: Any) -> Any:
        if isinstance(node, str) and node.startswith("{") and node.endswith("}") and node[1:-1] in values:
            return values[node[1:-1]]
        if isinstance(node, str):
            for name, value in values.items():
                node = node.replace("{" + name + "}", str(value))
            return node
        if isinstance(node, list):
            return [fill(x) for x in node]
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        return node

    raw = json.loads((REPLAYS / f"{client.replace('-', '_')}.json").read_text())
    return {**raw, "steps": [fill(step) for step in raw["steps"]]}


def call(base_url: str, step: dict[str, Any], api_key: str | None, timeout: float) -> tuple[int, Any]:
    body = step.get("body")
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    headers.update(step.get("headers", {}))
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(base_url.rstrip("/") + step["path"], data=data, headers=headers,
                                     method=step["method"])
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def read(doc: Any, path: str) -> list[Any]:
    """Every value at ``path`` (dots; ``*`` for each element): [] when one is missing."""
    found = [doc]
    for part in path.split("."):
        nxt = []
        for node in found:
            if part == "*" and isinstance(node, list):
                nxt.extend(node)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                nxt.append(node[int(part)])
            elif isinstance(node, dict) and part in node:
                nxt.append(node[part])
            else:
                return []
        found = nxt
    return found


def check(step: dict[str, Any], status: int, doc: Any) -> list[str]:
    """What in the answer is not what the client needs."""
    expect = step["expect"]
    wrong = []
    want = expect.get("status", "2xx")
    if ((want == "2xx" and not 200 <= status < 300) or (want == "refused" and status < 400)
            or (isinstance(want, int) and status != want)):
        wrong.append(f"status {status}, the client needs {want}: {str(doc)[:300]}")
    for path in expect.get("reads", []):
        if not read(doc, path) or any(v is None for v in read(doc, path)):
            wrong.append(f"{path} missing")
    for path, value in expect.get("equals", {}).items():
        if read(doc, path) != [value]:
            wrong.append(f"{path} is {read(doc, path)}, not {value!r}")
    for text in expect.get("message_names", []):
        message = json.dumps(doc)
        if text not in message:
            wrong.append(f"the refusal does not name {text!r}: {message[:300]}")
    return wrong


def replay(client: str, base_url: str, values: dict[str, Any], *, api_key: str | None = None,
           timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every step of ``client``'s replay, in order: what was sent, the status and what was wrong."""
    results = []
    for step in load(client, values)["steps"]:
        status, doc = call(base_url, step, api_key, timeout)
        results.append({"name": step["name"], "method": step["method"], "path": step["path"], "status": status,
                        "wrong": check(step, status, doc), "response": doc})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("client", choices=CLIENTS)
    p.add_argument("--base-url", required=True, help="redroll serve's URL, without /v1")
    p.add_argument("--api-key", default=None, help="a key of the gateway's --api-key-file (fleet control needs one)")
    p.add_argument("--model", required=True, help="the model name the gateway serves")
    p.add_argument("--weight-dir", default="/nonexistent", help="a checkpoint directory the workers can read")
    p.add_argument("--prompt-ids", type=int, nargs="+", default=[4, 37, 45, 53, 1, 5])
    p.add_argument("--eos-id", type=int, default=1)
    args = p.parse_args(argv)
    values = {"model": args.model, "weight_dir": args.weight_dir, "prompt_ids": args.prompt_ids, "eos_id": args.eos_id}
    results = replay(args.client, args.base_url, values, api_key=args.api_key)
    for r in results:
        print(f"{r['method']:4} {r['path']:45} {r['status']}  {'ok' if not r['wrong'] else '; '.join(r['wrong'])}")
    return 1 if any(r["wrong"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
