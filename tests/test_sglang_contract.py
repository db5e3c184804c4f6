"""The SGLang adapter and its stand-in against the real sglang wheel (parsed, not imported).

The wheel is fetched once with ``pip download --no-deps`` and cached (tests/sglang_contract.py);
a renamed or removed name in a future sglang fails here, naming it, not on a user's fleet.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import tomllib

import pytest

from redroll.engine_worker.engines import sglang_contract as contract
from redroll.engine_worker.engines import sglang_engine
from tests import sglang_contract as checker
from tests import sglang_standin as sgl
from tests.conftest import ROOT
from tests.sglang_standin import io_struct as standin_io
from tests.sglang_standin.server_args import DEFAULTS as STANDIN_SERVER_ARGS
from tests.sglang_standin.tokenizer_manager import SAMPLING_PARAM_NAMES

OLDER = "0.5.5"
"""An older release the contract must refuse (its async_generate has no rid, among others)."""


@pytest.fixture(scope="module")
def srt():
    return checker.wheel_source(contract.SGLANG_VERSION)


def test_the_pinned_wheel_has_every_name_the_adapter_relies_on(srt):
    assert checker.wheel_version(srt) == contract.SGLANG_VERSION
    assert checker.check(srt) == []


def test_an_older_wheel_fails_naming_what_it_lacks():
    missing = checker.check(checker.wheel_source(OLDER))
    assert "Engine.async_generate(rid=)" in missing
    assert "ReqState.dispatched" in missing and "TokenizerManager.enable_lora" in missing


def test_the_version_is_pinned_once_in_pyproject_the_dockerfile_and_the_adapter():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang=={contract.SGLANG_VERSION}"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    (pinned,) = re.findall(r"^ARG SGLANG_VERSION=(\S+)$", dockerfile, re.M)
    assert pinned == contract.SGLANG_VERSION == sglang_engine.SGLANG_VERSION
    # The image installs exactly that version and its build fails when another one is installed.
    assert re.search(r'pip install[^\n]*"sglang==\$\{SGLANG_VERSION\}"', dockerfile)
    assert "sglang.__version__" in dockerfile and "sys.exit" in dockerfile


def _adapter_modules() -> list:
    """Every module of the SGLang adapter: engine_worker/engines/sglang_*.py."""
    package = importlib.import_module(sglang_engine.__package__)
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("sglang_"))
    return [importlib.import_module(f"{sglang_engine.__package__}.{name}") for name in names]


def test_the_adapter_uses_only_names_the_contract_lists():
    modules = _adapter_modules()
    assert {"sglang_engine", "sglang_weights", "sglang_process", "sglang_output"} <= {
        m.__name__.rsplit(".", 1)[1] for m in modules}
    tm_used, engine_used = set(), set()
    for node in (n for module in modules for n in ast.walk(ast.parse(inspect.getsource(module)))):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "tm") or (
                isinstance(base, ast.Attribute) and base.attr == "tokenizer_manager"):
            tm_used.add(node.attr)
        elif isinstance(base, ast.Name) and base.id == "engine":
            engine_used.add(node.attr)
    allowed_tm = set(contract.TOKENIZER_MANAGER_METHODS) | set(contract.TOKENIZER_MANAGER_ATTRIBUTES)
    assert tm_used <= allowed_tm, tm_used - allowed_tm
    allowed_engine = set(contract.ENGINE_METHODS) | {"tokenizer_manager", "server_args"}
    assert engine_used <= allowed_engine, engine_used - allowed_engine
    # ... and ServerArgs only through the fields the contract names.
    named = set(inspect.signature(sglang_engine.SGLangEngine).parameters) & set(STANDIN_SERVER_ARGS)
    assert named <= set(contract.SERVER_ARGS_FIELDS)


def test_the_stand_in_follows_the_wheel(srt):
    """Every name the stand-in imitates exists in the real sglang, with the same parameters."""
    real_engine = checker._classes(srt / "entrypoints" / "engine.py")["Engine"]
    real_params = checker._params(checker._methods(real_engine)["async_generate"])
    assert set(inspect.signature(sgl.Engine.async_generate).parameters) - {"self"} <= real_params
    real_io = checker._classes(srt / "managers" / "io_struct.py")
    for name, cls in vars(standin_io).items():
        if dataclasses.is_dataclass(cls) and isinstance(cls, type) and name != "BaseReq":
            assert name in real_io, name
            mine = {f.name for f in dataclasses.fields(cls)} - {"rid", "http_worker_ipc"}
            assert mine <= checker._annotated(real_io[name]) | {"text"}, (name, mine - checker._annotated(real_io[name]))
    real_sampling = checker._init_or_fields(checker._classes(srt / "sampling" / "sampling_params.py")["SamplingParams"])
    assert SAMPLING_PARAM_NAMES <= real_sampling, SAMPLING_PARAM_NAMES - real_sampling
    assert set(STANDIN_SERVER_ARGS) <= checker.server_args_fields(srt)
    real_state = checker._annotated(checker._classes(srt / "managers" / "tokenizer_manager.py")["ReqState"])
    mine = {f.name for f in dataclasses.fields(sgl.ReqState)} - {"logprobs"}
    assert mine <= real_state, mine - real_state
    real_batch = checker._classes(srt / "managers" / "schedule_batch.py")
    for name, kind in contract.FINISH_REASON_TYPES.items():
        assert getattr(sgl, name)(*([1] if name != "FINISH_ABORT" else [])).to_json()["type"] == kind
        assert checker._finish_type(real_batch[name]) == kind


async def test_the_stand_in_has_every_name_the_adapter_relies_on():
    engine = sgl.Engine(model_path="/m")
    tm = engine.tokenizer_manager
    for name in [*contract.TOKENIZER_MANAGER_METHODS, *contract.TOKENIZER_MANAGER_ATTRIBUTES]:
        assert hasattr(tm, name), name
    for name in contract.ENGINE_METHODS:
        assert callable(getattr(engine, name)), name
    assert set(contract.ASYNC_GENERATE_PARAMS) <= set(inspect.signature(engine.async_generate).parameters)
    assert set(contract.SERVER_ARGS_FIELDS) <= set(STANDIN_SERVER_ARGS)
    for cls_name, fields in contract.IO_STRUCT_FIELDS.items():
        assert set(fields) <= {f.name for f in dataclasses.fields(getattr(standin_io, cls_name))}
    assert set(contract.REQ_STATE_FIELDS) <= {f.name for f in dataclasses.fields(sgl.ReqState)}
