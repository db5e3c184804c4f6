"""Check the names the SGLang adapter relies on (redroll.engine_worker.engines.sglang_contract)
against the source of a real sglang wheel, parsed with ``ast`` (importing it needs a GPU stack).

``wheel_source(version)`` downloads the wheel once (``pip download --no-deps``) into
``$REDROLL_CACHE`` (default ``~/.cache/redroll``) and unpacks its Python files; ``check(root)``
returns one line per missing name, e.g. ``Engine.async_generate(rid=)``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path

import msgspec

from redroll.engine_worker.engines import sglang_contract as contract
from redroll.shared.types import SamplingParams


def cache_dir() -> Path:
    return Path(os.environ.get("REDROLL_CACHE") or Path.home() / ".cache" / "redroll") / "sglang"


def wheel_source(version: str) -> Path:
    """The unpacked ``sglang/srt`` of sglang ``version`` (downloaded and unpacked once)."""
    root = cache_dir() / version
    done = root / ".unpacked"
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        wheels = list(root.glob(f"sglang-{version}-*.whl"))
        if not wheels:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                                   f"sglang=={version}", "-d", str(root)], capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"pip download sglang=={version} failed: {proc.stderr[-2000:]}")
            wheels = list(root.glob(f"sglang-{version}-*.whl"))
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if name.startswith("sglang/") and name.endswith(".py") or name.endswith("/METADATA"):
                    zf.extract(name, root)
        done.write_text(wheels[0].name)
    return root / "sglang" / "srt"


@lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _missing_members(classes: dict, wanted: dict, prefix: str, members, *, suffix: str = "") -> list[str]:
    """``prefix.Class`` for each wanted class that is absent, ``prefix.Class.name<suffix>`` for
    each wanted member (``members(cls)``: its fields or methods) that it lacks."""
    missing = []
    for cls_name, names in wanted.items():
        cls = classes.get(cls_name)
        if cls is None:
            missing.append(f"{prefix}.{cls_name}")
            continue
        have = members(cls)
        missing += [f"{prefix}.{cls_name}.{n}{suffix}" for n in names if n not in have]
    return missing


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    if not path.exists():
        return {}
    return {n.name: n for n in ast.walk(_parse(path)) if isinstance(n, ast.ClassDef)}


def _annotated(cls: ast.ClassDef) -> set[str]:
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {s.name: s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def _init_or_fields(cls: ast.ClassDef) -> set[str]:
    """A class's fields: annotated names (dataclass, msgspec Struct) or its __init__ parameters."""
    init = _methods(cls).get("__init__")
    return _annotated(cls) | (_params(init) - {"self"} if init is not None else set())


def server_args_fields(srt: Path) -> set[str]:
    names: set[str] = set()
    for cls in _classes(srt / "server_args.py").values():
        if cls.name == "ServerArgs":
            names |= _annotated(cls)
    for path in sorted((srt / "arg_groups" / "fields").glob("*.py")):  # 0.5.23: composed from namespaces
        for cls in _classes(path).values():
            names |= _annotated(cls)
    return names


def tokenizer_manager_classes(srt: Path) -> list[ast.ClassDef]:
    """TokenizerManager and the mixins it is made of (managers/tokenizer_*.py)."""
    out = []
    for path in sorted((srt / "managers").glob("*.py")):
        out += [c for c in _classes(path).values() if c.name.startswith("Tokenizer")]
    return out


def _self_attributes(classes: list[ast.ClassDef]) -> set[str]:
    names: set[str] = set()
    for cls in classes:
        for node in ast.walk(cls):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
        names |= set(_methods(cls)) | _annotated(cls)
    return names


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(_parse(path)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _finish_type(cls: ast.ClassDef) -> str | None:
    to_json = _methods(cls).get("to_json")
    if to_json is None:
        return None
    for node in ast.walk(to_json):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant):
                    return v.value
    return None


def redroll_sampling_keys() -> set[str]:
    """Every sampling key redroll forwards to SGLang (SamplingParams.engine_kwargs)."""
    return {f.name for f in msgspec.structs.fields(SamplingParams) if f.name != "n"}


def check(srt: Path) -> list[str]:
    """The contract's names missing from the sglang source under ``srt``, one line each."""
    missing: list[str] = []
    fields = server_args_fields(srt)
    missing += [f"ServerArgs.{n}" for n in contract.SERVER_ARGS_FIELDS if n not in fields]

    engine = _classes(srt / "entrypoints" / "engine.py").get("Engine")
    methods = _methods(engine) if engine is not None else {}
    for name in contract.ENGINE_METHODS:
        if name not in methods:
            missing.append(f"Engine.{name}()")
    if "async_generate" in methods:
        have = _params(methods["async_generate"])
        missing += [f"Engine.async_generate({p}=)" for p in contract.ASYNC_GENERATE_PARAMS if p not in have]

    sampling = _classes(srt / "sampling" / "sampling_params.py").get("SamplingParams")
    have = _init_or_fields(sampling) if sampling is not None else set()
    missing += [f"SamplingParams.{k}" for k in sorted(redroll_sampling_keys()) if k not in have]

    tm_classes = tokenizer_manager_classes(srt)
    tm_methods = {name: fn for cls in tm_classes for name, fn in _methods(cls).items()}
    for name, params in contract.TOKENIZER_MANAGER_METHODS.items():
        fn = tm_methods.get(name)
        if fn is None:
            missing.append(f"TokenizerManager.{name}()")
            continue
        missing += [f"TokenizerManager.{name}({p}=)" for p in params if p not in _params(fn)]
    attrs = _self_attributes(tm_classes)
    missing += [f"TokenizerManager.{a}" for a in contract.TOKENIZER_MANAGER_ATTRIBUTES if a not in attrs]

    state = _classes(srt / "managers" / "tokenizer_manager.py").get("ReqState")
    have = _annotated(state) if state is not None else set()
    missing += [f"ReqState.{f}" for f in contract.REQ_STATE_FIELDS if f not in have]

    missing += _missing_members(_classes(srt / "managers" / "io_struct.py"), contract.IO_STRUCT_FIELDS,
                                "io_struct", _annotated)

    batch = _classes(srt / "managers" / "schedule_batch.py")
    for cls_name, kind in contract.FINISH_REASON_TYPES.items():
        cls = batch.get(cls_name)
        if cls is None or _finish_type(cls) != kind:
            missing.append(f"schedule_batch.{cls_name} (to_json type {kind!r})")

    strings = _string_constants(srt / "managers" / "tokenizer_manager.py")
    missing += [f"meta_info[{k!r}]" for k in contract.META_INFO_KEYS if k not in strings]
    missing += [f"output[{k!r}]" for k in contract.OUTPUT_KEYS if k not in strings]

    missing += _missing_members(_classes(srt / "utils" / "common.py"), contract.UTILS_CLASSES, "utils", _methods,
                                suffix="()")
    versions = srt / "utils" / "weight_versions.py"
    have = _string_constants(versions) if versions.exists() else set()
    missing += [f"weight_versions[{k!r}]" for k in contract.WEIGHT_VERSION_KEYS if k not in have]
    scheduler = srt / "managers" / "scheduler.py"
    have = _string_constants(scheduler) if scheduler.exists() else set()
    missing += [f"pause mode {m!r}" for m in contract.PAUSE_MODES if m not in have]

    constants = {}
    if (srt / "constants.py").exists():
        for node in _parse(srt / "constants.py").body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                constants.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    missing += [f"constants.{k} == {v!r}" for k, v in contract.CONSTANTS.items() if constants.get(k) != v]
    return missing


def wheel_version(srt: Path) -> str | None:
    for meta in srt.parent.parent.glob("sglang-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None
