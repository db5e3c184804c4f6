"""benchmarks.redis_profile: each perf sample in one part of redis-server's CPU, by its stack."""

from __future__ import annotations

import pytest

from benchmarks.redis_profile import PARTS, samples, split

ROOT = ["__libc_start_call_main", "main", "aeMain", "aeProcessEvents.part.0"]
COMMAND = ROOT + ["connSocketEventHandler", "readQueryFromClient", "processInputBuffer", "processCommand", "call"]
SCRIPT = COMMAND + ["evalGenericCommand", "luaCallFunction"]
IN_LUA = SCRIPT + ["lua_pcall", "luaD_call", "luaV_execute", "luaD_precall", "luaRedisGenericCommand"]


def perf_script(*stacks: list[str]) -> str:
    """``perf script -F tid,ip,sym`` text of ``stacks`` (root first): a header, then frames leaf first."""
    blocks = []
    for stack in stacks:
        frames = [f"\t{0x1000 + i:x} {name}" for i, name in enumerate(reversed(stack))]
        blocks.append("redis-server 13091 \n" + "\n".join(frames))
    return "\n\n".join(blocks) + "\n"


def test_each_sample_lands_in_one_part_by_its_stack():
    text = perf_script(
        ["[unknown]"],                                                     # cut by a library: unattributed
        SCRIPT + ["luaCreateArray", "lua_pushlstring", "luaS_newlstr"],   # KEYS/ARGV into Lua strings
        IN_LUA + ["scriptCall", "call", "xaddCommand", "streamAppendItem"],
        IN_LUA + ["scriptCall", "call", "getGenericCommand", "lookupKey"],
        IN_LUA + ["scriptCall", "lookupCommand"],                          # before the call: the checks
        IN_LUA + ["parseReply", "lua_pushlstring"],                        # the reply into Lua
        SCRIPT + ["lua_pcall", "luaD_call", "luaV_execute"],               # the interpreter
        COMMAND + ["xreadCommand", "streamReplyWithRange"],
        COMMAND + ["execCommand", "call", "saddCommand"],
        ROOT + ["beforeSleep", "handleClientsWithPendingWrites", "writeToClient"],
    )
    out = split(samples(text), us_per_request=20.0)
    assert out["samples"] == 10
    shares = {name: p["share"] for name, p in out["parts"].items()}
    assert shares == {"script_arguments": 0.1, "script_commands": 0.3, "script_crossing": 0.1, "script_lua": 0.1,
                      "commands": 0.2, "io": 0.1, "unattributed": 0.1}
    assert list(out["parts"]) == list(PARTS)
    assert out["parts"]["script_commands"]["us_per_request"] == 6.0
    assert out["commands_in_scripts"] == {
        "XADD": {"share": 0.1, "us_per_request": 2.0}, "GET": {"share": 0.1, "us_per_request": 2.0},
        "(checks before the call: command lookup, ACL)": {"share": 0.1, "us_per_request": 2.0}}
    # a command run by MULTI/EXEC counts as the transaction (the outermost command sent)
    assert set(out["commands_alone"]) == {"XREAD/XREADGROUP", "MULTI/EXEC"}


def test_a_server_without_symbols_is_refused_with_the_reason():
    stripped = perf_script(["0x15e6b1"], ["lua_close@@Base", "0x5561376526b1"])
    with pytest.raises(SystemExit, match="no symbols or frame pointers"):
        split(samples(stripped), us_per_request=20.0)
