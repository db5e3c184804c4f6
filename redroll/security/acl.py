"""Least-privilege Redis ACL rules for the roles of a pipeline (see docs/acl.md).

``acl_rules(role, namespace)`` renders the rules of one role as the text that follows
``ACL SETUSER <name> reset on ><password>`` (or ``user <name> on ><password>`` in an ACL file).

How the rules are built (Redis 7 / Valkey 7.2+ ACL semantics, checked by tests/test_security.py):

- The root permissions hold only commands without keys (PING, MULTI/EXEC, SCAN) and FCALL, the
  entry point of the project's function library (shared/functions.py): no role may run Lua of its
  own (no EVAL, EVALSHA, SCRIPT, FUNCTION). Redis checks a function's declared KEYS as read+write,
  so the root lists, read+write, exactly the keys this role passes to its functions — and no
  command that could use them directly.
- Every command a role runs on keys, directly *or inside one of the functions* (Redis checks the
  commands a function calls against the calling user too), is granted in a selector ``(...)`` that
  names only the keys it may touch, read (``%R~``), write (``%W~``) or both (``~``). So the
  producer may only create ``rid`` keys (SETNX: never overwrite, expire or delete one), XACK only
  its reply stream; the worker may XACK only
  the request streams; the consumer may write nothing but its result stream, the dead-letter
  stream and its de-duplication sets.
- No pub/sub channels (``resetchannels``), no other namespace, no admin or dangerous commands
  (FLUSHALL, CONFIG, KEYS, ACL, SCRIPT FLUSH, DEBUG, ...).

Limits of Redis ACLs that no rule can close: commands are granted per key pattern, not per call
site, so a command a function needs is also allowed outside it (the producer can XDEL a queued
request of its namespace because cancelling one does), and not per option (XADD ... MAXLEN 0
empties a stream the role may write); SCAN (worker housekeeping) lists key names of the whole
database, although it cannot read them. docs/acl.md lists what remains possible.
"""

from __future__ import annotations

from dataclasses import dataclass

from redroll.shared.keys import Keys

ROLES = ("producer", "worker", "consumer", "operator", "gateway")

READ, WRITE, READ_WRITE = "%R~", "%W~", "~"


@dataclass(frozen=True)
class Grant:
    """Commands allowed on some key patterns (a selector), and why the role needs them."""

    commands: tuple[str, ...]
    keys: tuple[str, ...]
    """Each with its permission prefix: ``~`` (read+write), ``%R~`` or ``%W~``."""
    why: str

    def render(self) -> str:
        return " ".join([*(f"+{c}" for c in self.commands), *self.keys])


def glob_escape(text: str) -> str:
    """``text`` as a literal in an ACL key pattern (``*``, ``?``, ``[``, ``]`` and ``\\`` escaped)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def connection_commands(server_version: str | None = None) -> tuple[str, ...]:
    """What every redis-py client sends outside its own calls.

    PING: connection health checks. WAIT (WAITAOF from 7.2): ``wait_replicas`` (see
    redroll.shared.connection.durability). CLIENT SETINFO: redis-py announces its library name and
    version on connect (Redis 7.2+ and Valkey; 7.0 does not know the subcommand and refuses it in
    an ACL rule, so it is left out for ``server_version`` < 7.2; redis-py ignores the refusal).
    AUTH and HELLO need no grant.
    """
    cmds = ["ping", "wait"]
    if server_version is None or _version_tuple(server_version) >= (7, 2):
        cmds += ["client|setinfo", "waitaof"]
    return tuple(cmds)


def role_grants(role: str, namespace: str | Keys = "redroll", *, server_version: str | None = None,
                producer: str | None = None, group: str | None = None, stream: str | None = None,
                partitions: int = 1) -> list[Grant]:
    """The grants of ``role``; the first is the root, the others become selectors.

    ``partitions``: with P > 1 the per-request keys (requests, results, reply, dead, rid, applied)
    are granted on the partition tags ``{ns:0}`` … (pattern ``{ns:[0-9]*}``), the pipeline-wide
    ones (control, weights, workers, errors, aborted) on ``{ns}`` as before.

    ``producer``: restrict a producer to the reply stream of that producer name (default: every
    reply stream of the namespace, as producers get unique names per process unless named).
    ``group`` / ``stream``: restrict a consumer's de-duplication sets to one consumer group / let
    it consume another result stream of the pipeline than ``{ns}:results``.
    """
    keys = namespace if isinstance(namespace, Keys) else Keys(namespace)
    t = glob_escape(keys.tag)
    # Per-request keys: the plain tag {ns}, or with partitions every partition tag {ns:<digits>}.
    pt = t if partitions == 1 else glob_escape("{" + keys.namespace + ":") + "[0-9]*}"
    requests, requests_high, lanes = f"{pt}:requests", f"{pt}:requests:high", f"{pt}:requests:lane:*"
    results, dead = f"{pt}:results", f"{pt}:dead"
    control, handbacks = f"{t}:control", f"{t}:handbacks"
    weights, workers, errors, aborted = f"{t}:weights", f"{t}:workers", f"{t}:errors", f"{t}:aborted"
    lane_members, lane_full, lane_plan = f"{t}:lanes:members", f"{t}:lanes:full", f"{t}:lanes:plan"
    rid = f"{pt}:rid:*"
    partial = f"{pt}:partial:*"
    events = f"{pt}:events:*"
    finished = f"{pt}:finished:*"
    replies = f"{pt}:reply:*"
    owners = f"{pt}:own:*"
    chunks = f"{pt}:chunks:*"
    parts = f"{pt}:parts:*"
    reclaim_marks = f"{pt}:reclaim_marks"
    wsync = f"{t}:wsync:*"
    config = f"{t}:config"
    sessions = f"{t}:session:*"
    conn = connection_commands(server_version)
    rw = lambda *ks: tuple(READ_WRITE + k for k in ks)  # noqa: E731
    rd = lambda *ks: tuple(READ + k for k in ks)  # noqa: E731
    wr = lambda *ks: tuple(WRITE + k for k in ks)  # noqa: E731
    scripts = ("fcall",)

    if role == "gateway":  # (redroll serve: a producer of every reply stream, plus what keyed calls need)
        root, *rest = role_grants("producer", keys, server_version=server_version, partitions=partitions)
        return [Grant((*root.commands, "unwatch"), root.keys, root.why + "; UNWATCH (ends a keyed call's WATCH)"),
                *rest,
                Grant(("watch", "xread"), rw(replies),
                      "a keyed call's reply stream: WATCH it around the submit, XREAD its records"),
                Grant(("xlen",), rd(requests, requests_high, lanes), "--max-queued: the pipeline's backlog"),
                Grant(("xread",), rd(control), "fleet control: the workers' command_failed reports after a pause, "
                                               "resume or weight update"),
                Grant(("get", "set"), rw(sessions), "token-exact sessions: a session's conversation ids, read at a "
                                                    "turn's start and written (with its window's expiry) at its end")]
    if role == "producer":
        own = f"{pt}:reply:{glob_escape(producer)}" if producer else replies
        owner = f"{pt}:own:{glob_escape(producer)}" if producer else owners
        own_chunks = f"{pt}:chunks:{glob_escape(producer)}" if producer else chunks
        return [
            Grant((*conn, "multi", "exec", *scripts),
                  rw(requests, requests_high, lanes, rid, own, owner, dead, events),
                  "connection upkeep; MULTI/EXEC (abort, weight update); the functions submit_many, ack_replies, "
                  "cancel_queued and dead_letter with the keys they are given (FCALL: checked read+write)"),
            Grant(("xadd", "xrange", "xpending", "xinfo|groups", "xdel"), rw(requests, requests_high, lanes),
                  "submit (XADD in submit_many.lua); cancel a queued request on abort (XRANGE, XPENDING, "
                  "XINFO GROUPS, XDEL in cancel_queued.lua)"),
            Grant(("set", "append", "get", "expire", "time"), rw(events),
                  "requests' event logs: a dead letter of an undecodable record (dead_letter.lua; TIME: the "
                  "event's time)"),
            Grant(("get", "setnx", "mget"), rw(rid),
                  "submit de-duplication keys: created with the XADD (SETNX, no expiry: nothing that could "
                  "overwrite, expire or delete another producer's), read to find a queued request"),
            Grant(("xgroup|create", "expire", "xreadgroup", "xpending", "xack", "xdel", "xadd", "xrange"), rw(own),
                  "its private reply stream: create the group, keep the TTL fresh, read and ack+delete "
                  "records, dead-letter an undecodable one, receive the record of a cancelled request; "
                  "`submit --resume` reads the records that came while nothing read (XRANGE)"),
            Grant(("type", "hset", "hget", "hmget", "expire", "hdel"), rw(owner),
                  "its ownership hash: the submit notes each request it queues for its reply stream there "
                  "(request_id → stream and entry id; the worker publishes to the reply stream only what it names) "
                  "and reads a finished one's mark (a retried submit is not queued again), a cancelled one is "
                  "taken out, and the ack takes out the marks of the records it acks (ack_replies.lua)"),
            Grant(("xread", "xrange", "xrevrange"), rd(own_chunks),
                  "streamed requests: read their chunks (XREVRANGE: where the stream ends before a submit; "
                  "only its own chunk stream when narrowed)"),
            Grant(("xadd",), wr(dead, control),
                  "dead letters of undecodable records, abort / weight / drain commands on the control stream "
                  "(no results stream: the worker publishes a cancelled fire-and-forget request's record)"),
            Grant(("xread", "xrevrange"), rd(dead),
                  "watch for dead letters of its requests whose reply stream refused the error record"),
            Grant(("zadd", "zremrangebyscore"), wr(aborted), "mark request/group ids aborted, prune old marks"),
            Grant(("hset", "hget", "hgetall"), rw(weights),
                  "set (and show) the desired weights; the version a cancelled request's record names"),
            Grant(("hgetall",), rd(workers), "wait until every live worker runs the new weights"),
            Grant(("hgetall",), rd(wsync), "a trainer's weight push: the workers' progress"),
            Grant(("hget", "hsetnx"), rw(config), "agree on the number of affinity lanes (publish it first)"),
        ]
    if role == "worker":
        return [
            Grant((*conn, "multi", "exec", *scripts, "scan", "time", "client|id", "client|unblock"),
                  rw(requests, requests_high, lanes, rid, partial, finished, owners, results, replies, dead, events,
                     chunks, parts, reclaim_marks, workers, config, lane_members, lane_full, lane_plan),
                  "connection upkeep; MULTI/EXEC (a push's progress report); the functions finish_many, dead_letter, "
                  "renew, claim and claim_lanes (TIME: server time for overdue lane entries), reclaim_scan and "
                  "lanes_beat (TIME: server time for idle entries and heartbeats), and housekeeping's "
                  "delete_consumer_if_empty and release_rids with their keys (FCALL); SCAN ... TYPE for reply "
                  "streams, rid keys and checkpoints to collect (SCAN is keyless: ACLs cannot narrow it); CLIENT "
                  "ID on its blocking claim read's connection and CLIENT UNBLOCK ... TIMEOUT from another, to cut "
                  "that read short when it stops or its lanes change (it returns as if it timed out, nothing "
                  "delivered; keyless, so not narrowed to its own connections)"),
            Grant(("xgroup|create", "xreadgroup", "xpending", "xclaim", "xack", "xdel", "xinfo|consumers",
                   "xinfo|groups", "xrange", "xlen", "xgroup|delconsumer"), rw(requests, requests_high, lanes),
                  "claim (XREADGROUP, plain or in claim.lua; claim_lanes.lua also XINFO GROUPS and XRANGE to find overdue lane "
                  "entries, XLEN to skip empty lanes), "
                  "reclaim (XPENDING ... IDLE, XCLAIM), renew and hand back leases "
                  "(renew.lua), fenced finish and dead letters (XACK+XDEL), drop idle empty consumers"),
            Grant(("get", "del", "exists"), rw(rid), "release the submit de-duplication key in the finish "
                  "or a dead letter; housekeeping releases those whose entry is gone (release_rids.lua: a "
                  "request cancelled while queued) and asks whether a checkpoint's request is still there"),
            Grant(("get", "getrange", "set", "append", "setrange", "expire", "pttl", "del", "type"), rw(partial),
                  "checkpoints of requests that continue: load one to resume, append parts (checkpoint_many.lua), "
                  "delete it with the finish or a dead letter, or when GC finds it orphaned"),
            Grant(("type", "xadd", "expire", "xdel"), rw(chunks),
                  "streamed requests' chunks: a call's chunks for one producer added as one entry with their "
                  "checkpoint parts, trimming the stream to its TTL (checkpoint_many.lua, save_parts.lua: TYPE "
                  "before the writes, the TTL set again; XDEL takes a call's chunk entry out again when its "
                  "parts stream refused the parts)"),
            Grant(("type", "xadd", "expire", "xrevrange", "del"), rw(parts),
                  "checkpoint parts saved between two consolidations of a checkpoint, one entry a call "
                  "(save_parts.lua, trimmed by age, its TTL set again), read back newest first by the worker "
                  "that continues a request; housekeeping deletes a dropped consumer's"),
            Grant(("hget", "hset", "hdel"), rw(owners),
                  "the ownership check before publishing to a producer's reply stream (finish_many.lua, and "
                  "before an error record): the producer's hash names the entry; the finish or dead letter turns "
                  "its field into a finished mark, which the producer's ack takes out"),
            Grant(("type", "lrange", "rpush", "ltrim", "pexpire"), rw(finished),
                  "finish markers: the entries a worker finished lately, written and read by finish_many.lua "
                  "so a retried finish whose reply was lost is told from a lost lease"),
            Grant(("xadd",), wr(results, dead), "publish records (finish_many.lua, MAXLEN ~ cap) and dead letters"),
            Grant(("set", "append", "get", "exists", "expire", "strlen", "getrange", "setrange"), rw(events),
                  "requests' event logs: what a worker takes back (pipelined with the reclaim); checkpoints "
                  "(a run's line rewritten in place: STRLEN, GETRANGE, SETRANGE), "
                  "finishes (EXISTS: with event_log=incidents, only a log an incident began) and dead letters "
                  "(in their functions; past its cap a log is rewritten: GET, SET)"),
            Grant(("xadd", "ttl", "xinfo|stream", "xinfo|groups", "xinfo|consumers", "del"), rw(replies),
                  "publish records to producers' reply streams; housekeeping finds reply streams of "
                  "producers that never came back (TTL, XINFO) and deletes them"),
            Grant(("xread", "xrevrange"), rd(control, handbacks),
                  "follow the control stream (abort, drain, weights) and the other workers' hand-back notes "
                  "(an idle worker takes what a worker given notice handed back at once), in one read"),
            Grant(("xadd",), wr(handbacks), "note the entries it hands back on a notice"),
            Grant(("hget", "hgetall"), rd(weights), "load the desired weights at start and check a min_weight_version"),
            Grant(("zadd", "zscore"), rw(reclaim_marks),
                  "hand-back marks: how new the entries handed back on each request stream are (renew.lua), "
                  "so that reclaim passes look that far (reclaim_scan.lua)"),
            Grant(("hset", "hdel", "hgetall"), rw(workers), "heartbeat, deregister, drop stale heartbeats"),
            Grant(("zadd", "zrem", "zrange", "zrangebyscore", "sadd", "srem", "smembers", "set", "get"),
                  rw(lane_members, lane_full, lane_plan),
                  "the affinity lanes' table (lanes_beat.lua, with the heartbeat): the claiming workers and "
                  "when each beat last, those without a free slot, the published member list"),
            Grant(("hset", "hget", "hmget", "hdel"), rw(errors), "last engine error / hand-back note per entry"),
            Grant(("zrangebyscore",), rd(aborted),
                  "load the aborted ids at start (later ones come on the control stream)"),
            Grant(("hset", "expire"), wr(wsync),
                  "report its progress in a trainer's weight push (joined, received, committed, failed)"),
            Grant(("hget", "hsetnx", "hmget", "hset", "hincrby"), rw(config),
                  "agree on the number of affinity lanes (publish it first); the lane table's epoch "
                  "(lanes_beat.lua)"),
        ]
    if role == "consumer":
        source = glob_escape(stream) if stream else results
        applied = f"{pt}:applied:{glob_escape(group)}:*" if group else f"{pt}:applied:*"
        return [
            Grant((*conn, "multi", "exec", *scripts), rw(source, dead, events),
                  "connection upkeep; MULTI/EXEC (mark applied + ack); the functions dead_letter and "
                  "renew with their keys (FCALL)"),
            Grant(("xgroup|create", "xreadgroup", "xautoclaim", "xpending", "xclaim", "xack", "xinfo|groups",
                   "xtrim"), rw(source),
                  "read records through the group, reclaim a dead consumer's (XAUTOCLAIM), hand back a failed "
                  "callback (renew.lua), ack, trim below what every group acked (XINFO GROUPS, XTRIM MINID)"),
            Grant(("xadd",), wr(dead), "dead-letter records that cannot be applied"),
            Grant(("smismember", "sadd", "expireat"), rw(applied), "callback de-duplication markers"),
            Grant(("xlen",), rd(requests, requests_high, lanes),
                  "burst mode: is any request still queued or claimed, a record still to come? (the "
                  "request streams' lengths, nothing of the requests)"),
            Grant(("set", "append", "get", "expire", "time"), rw(events),
                  "requests' event logs: a dead letter of a record that cannot be applied (dead_letter.lua; "
                  "TIME: the event's time)"),
        ]
    if role == "operator":
        everything = (f"{t}:*",) if partitions == 1 else (f"{t}:*", f"{pt}:*")
        return [
            Grant((*conn, "info"), (), "connection upkeep; INFO memory (status reports a Redis out of memory)"),
            Grant(("xlen", "xrange", "xrevrange", "xinfo|stream", "xinfo|groups", "xinfo|consumers", "xpending",
                   "hgetall", "hget", "hlen", "zcard", "ttl", "type", "exists", "get", "getrange", "sismember"),
                  rd(*everything),
                  "read-only: redroll status, dead list, weights show, trace, and the README's redis-cli "
                  "inspection commands; nothing that writes"),
        ]
    raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")


def acl_rule_list(role: str, namespace: str | Keys = "redroll", **kw) -> list[str]:
    """The rules as ``ACL SETUSER`` arguments (each selector one argument)."""
    grants = role_grants(role, namespace, **kw)
    root = ["resetkeys", "resetchannels", "clearselectors", "-@all", *grants[0].render().split()]
    return root + [f"({g.render()})" for g in grants[1:]]


def acl_rules(role: str, namespace: str | Keys = "redroll", **kw) -> str:
    """The ACL rules of ``role`` in ``namespace`` as one line, without user name or password.

    Use as ``ACL SETUSER <name> reset on ><password> <rules>`` or in an ACL file as
    ``user <name> on ><password> <rules>``. ``server_version`` (e.g. "7.0.15") leaves out what
    older servers do not know; see :func:`role_grants` for the other options.
    """
    return " ".join(acl_rule_list(role, namespace, **kw))


def setuser_args(username: str, password: str, role: str, namespace: str | Keys = "redroll", **kw) -> list[str]:
    """``ACL SETUSER`` arguments creating (or resetting) ``username`` for ``role``:
    ``client.execute_command("ACL", "SETUSER", *setuser_args(...))``."""
    return [username, "reset", "on", f">{password}", *acl_rule_list(role, namespace, **kw)]
