"""Whether an engine's declared capabilities and its members agree (every engine's tests assert
it), and reading the declaration (:func:`capabilities_of`)."""

from __future__ import annotations

import inspect
from typing import Any

from redroll.engine_worker.engines.base import CAPABILITY_PROTOCOLS, EngineCapabilities

NO_CAPABILITIES = EngineCapabilities()
"""What an engine that declares nothing can do beyond :class:`Engine`: nothing."""


def capabilities_of(engine: Any) -> EngineCapabilities:
    """An engine's declaration; :data:`NO_CAPABILITIES` for an engine object that has none (a
    stand-in written before declarations). The worker reads it once, when it is built."""
    declared = getattr(engine, "capabilities", NO_CAPABILITIES)
    if not isinstance(declared, EngineCapabilities):
        raise TypeError(f"{type(engine).__name__}.capabilities is a {type(declared).__name__}, "
                        "not an EngineCapabilities")
    return declared


def _members(protocol: type) -> dict[str, Any]:
    """A protocol's own members: name → its function (a method), its property, or None (an attribute)."""
    out: dict[str, Any] = {name: None for name in vars(protocol).get("__annotations__", {})}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
            out[name] = value
    return out


def _signature_mismatch(wanted: Any, method: Any, optional: frozenset[str] = frozenset()) -> str | None:
    """Why ``method`` cannot be called as the protocol's ``wanted`` is called (None: it can);
    ``optional``: parameters the worker passes only when another capability is declared."""
    if inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(method):
        return "must be async" if inspect.iscoroutinefunction(wanted) else "must not be async"
    try:
        have = inspect.signature(method).parameters
    except (TypeError, ValueError):  # (a builtin without a signature: taken on trust)
        return None
    want = [p for p in inspect.signature(wanted).parameters.values() if p.name != "self"]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in have.values())
    missing = [p.name for p in want if p.name not in have and p.name not in optional and not takes_any]
    if missing:
        return f"has no parameter {', '.join(missing)}"
    wanted_names = {p.name for p in want}
    extra = [name for name, p in have.items() if name not in wanted_names and p.default is inspect.Parameter.empty
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if extra:
        return f"requires parameter {', '.join(extra)} the worker does not pass"
    return None


def _accepts(method: Any, parameter: str) -> bool:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return parameter in parameters


def check_declaration(engine: Any, *, undeclared: bool = True) -> list[str]:
    """Where ``engine``'s declaration and its members disagree (empty when they agree):

    * a declared capability with a member missing, or not callable as the worker calls it (a sync
      method for an async one, a parameter missing, a required parameter the worker does not pass);
    * ``weights_in_place`` without ``weights_from_disk``, or without an ``in_place`` parameter;
    * no ``capacity`` attribute; a declared tokenizer (once there is one) missing a :class:`~.base.Tokenizer` member;
    * with ``undeclared``: a capability whose members are all there but which is not declared (an
      engine that declares less than it has on purpose, as the synthetic engine's ``instant``
      with per-token time, is checked with ``undeclared=False``).
    """
    declared = capabilities_of(engine)
    name = type(engine).__name__
    problems: list[str] = []
    for capability, protocol in CAPABILITY_PROTOCOLS.items():
        on = getattr(declared, capability)
        optional = frozenset() if declared.weights_in_place else frozenset({"in_place"})
        members = _members(protocol)
        missing: list[str] = []
        unfit: list[str] = []
        for member, wanted in members.items():
            if wanted is None or isinstance(wanted, property):
                if not hasattr(engine, member):
                    missing.append(member)
                continue
            method = getattr(engine, member, None)
            if not callable(method):
                missing.append(member)
                continue
            why = _signature_mismatch(wanted, method, optional if capability == "weights_from_disk" else frozenset())
            if why is not None:
                unfit.append(f"{name} declares {capability}: its {member} {why}")
        if on:
            problems.extend(unfit)
            if missing:
                problems.append(f"{name} declares {capability} but has no {', '.join(missing)}")
        elif undeclared and not missing and not unfit:
            problems.append(f"{name} has {', '.join(members)} but does not declare {capability}")
    if not hasattr(engine, "capacity"):
        problems.append(f"{name} declares no capacity (None: it runs whatever it is given at once)")
    if declared.tokenizer and getattr(engine, "tokenizer", None) is not None:
        tokenizer = engine.tokenizer
        lacking = [m for m in ("encode", "decode", "apply_chat_template") if not callable(getattr(tokenizer, m, None))]
        lacking += [] if hasattr(tokenizer, "chat_template") else ["chat_template"]
        if lacking:
            problems.append(f"{name} declares tokenizer but its tokenizer has no {', '.join(lacking)}")
    update = getattr(engine, "update_weights_from_disk", None)
    if declared.weights_in_place and not declared.weights_from_disk:
        problems.append(f"{name} declares weights_in_place without weights_from_disk")
    elif (undeclared and declared.weights_from_disk and not declared.weights_in_place and update is not None
          and _accepts(update, "in_place")):
        problems.append(f"{name}'s update_weights_from_disk takes in_place but it does not declare weights_in_place")
    return problems


