"""The SGLang and vLLM adapters send what those engines' own request models accept: checked against the source
shipped in their wheels (downloaded once from PyPI into the cache, never installed). Importing the modules needs a
GPU stack (SGLang's ``io_struct`` pulls in torchvision and tvm-ffi kernels; vLLM's needs transformers, pyzmq and
more), so the models are read from their source: every field we send exists, every required field is sent, and the
routes we call exist with the body shape we use. The same for the rollouts' token-in/token-out requests (vLLM's
``/v1/completions`` with a token-id prompt, SGLang's ``/generate`` with ``input_ids``) and the response fields the
endpoints read back (the bodies themselves: tests/workers/rollout/test_engine_kinds.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile

import pytest

from kiln.streams.settings import get_settings
from kiln.workers.inference.endpoints import SGLangEndpoint, VLLMEndpoint
from kiln.workers.inference.errors import WeightUpdateRejected
from kiln.workers.inference.weights import InitProcessGroupRequest, ParameterInfo, WeightUpdateRequest

WHEELS = {"sglang": ("0.5.23", "cp311-cp311-manylinux_2_34_x86_64"),
          "vllm": ("0.33.0", "cp38-abi3-manylinux_2_28_x86_64")}
INIT = InitProcessGroupRequest(master_address="10.0.0.1", master_port=29500, rank=1, world_size=3, backend="nccl",
                               group_name="kiln-weights/abc/")
UPDATE = WeightUpdateRequest(version=7, parameters_info=[ParameterInfo(name="h.0.w", shape=[4, 8], dtype="bfloat16"),
                                                         ParameterInfo(name="h.0.b", shape=[8], dtype="bfloat16")])


def _wheel(name: str) -> zipfile.ZipFile:
    """The engine's wheel, fetched once with ``pip download --no-deps`` into the cache (older versions dropped)."""
    version, tag = WHEELS[name]
    cache = get_settings().cache / "engine-wheels"
    path = cache / f"{name}-{version}-{tag}.whl"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        for stale in cache.glob(f"{name}-*.whl"):
            stale.unlink()
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        f"{name}=={version}", "-d", str(cache)], check=True, timeout=900)
    return zipfile.ZipFile(path)


@pytest.fixture(scope="module")
def sources() -> dict[str, ast.Module]:
    wanted = {"sglang": ["sglang/srt/managers/io_struct.py", "sglang/srt/entrypoints/http_server.py",
                         "sglang/api/v1/api_types.py", "sglang/srt/managers/tokenizer_manager.py",
                         "sglang/srt/utils/weight_versions.py"],
              "vllm": ["vllm/distributed/weight_transfer/nccl_common.py",
                       "vllm/distributed/weight_transfer/nccl_engine.py",
                       "vllm/entrypoints/rl/online/api_router.py",
                       "vllm/entrypoints/openai/completion/protocol.py",
                       "vllm/entrypoints/openai/completion/api_router.py"]}
    parsed = {}
    for name, members in wanted.items():
        with _wheel(name) as wheel:
            for member in members:
                parsed[member] = ast.parse(wheel.read(member))
    return parsed


def _fields(module: ast.Module, cls: str, inherited: dict[str, bool] | None = None) -> dict[str, bool]:
    """Field name -> required, from a dataclass or msgspec Struct definition."""
    node = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fields = dict(inherited or {})
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            fields[item.target.id] = item.value is None
    return fields


def _routes(module: ast.Module) -> dict[str, ast.AsyncFunctionDef]:
    """POST route path -> handler, from ``@app.post("/...")`` / ``@router.post("/...")`` decorators (and
    ``@app.api_route("/...", methods=[..."POST"...])``)."""
    routes = {}
    for node in module.body:
        if isinstance(node, ast.AsyncFunctionDef):
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                        and (deco.func.attr == "post" or (deco.func.attr == "api_route" and "'POST'" in
                             ast.unparse(deco)))
                        and deco.args and isinstance(deco.args[0], ast.Constant)):
                    routes[str(deco.args[0].value)] = node
    return routes


def _function(module: ast.Module, cls: str, name: str) -> str:
    """The source of method ``name`` of class ``cls``."""
    node = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return ast.unparse(next(f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                            and f.name == name))


def _check(sent: dict[str, object], fields: dict[str, bool]) -> None:
    assert set(sent) <= set(fields), f"unknown fields {set(sent) - set(fields)}"
    assert {f for f, required in fields.items() if required} <= set(sent)


def test_sglang_requests_match_its_models(sources: dict[str, ast.Module]) -> None:
    io_struct = sources["sglang/srt/managers/io_struct.py"]
    base = _fields(io_struct, "BaseReq")
    _check(SGLangEndpoint.init_body(INIT), _fields(io_struct, "InitWeightsUpdateGroupReqInput", base))
    endpoint = SGLangEndpoint("http://sglang:30000", group_name=INIT.group_name)
    body = endpoint.update_body(UPDATE)
    _check(body, _fields(io_struct, "UpdateWeightsFromDistributedReqInput", base))
    assert body["names"] == ["h.0.w", "h.0.b"] and body["shapes"] == [[4, 8], [8]] and body["weight_version"] == "7"
    routes = _routes(sources["sglang/srt/entrypoints/http_server.py"])
    for route, model in (("/init_weights_update_group", "InitWeightsUpdateGroupReqInput"),
                         ("/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput")):
        assert model in ast.unparse(routes[route].args)  # the body is that model, not embedded


def test_vllm_requests_match_its_models(sources: dict[str, ast.Module]) -> None:
    init = VLLMEndpoint.init_body(INIT)
    _check(init["init_info"], _fields(sources["vllm/distributed/weight_transfer/nccl_common.py"],
                                      "NCCLWeightTransferInitInfo"))
    routes = _routes(sources["vllm/entrypoints/rl/online/api_router.py"])

    def embedded(route: str) -> set[str]:
        handler = routes[route]
        return {a.arg for a in handler.args.args if a.annotation is not None and "Body(embed=True)"
                in ast.unparse(a.annotation)}

    assert set(init) == embedded("/init_weight_transfer_engine")
    update_fields = _fields(sources["vllm/distributed/weight_transfer/nccl_engine.py"],
                            "NCCLWeightTransferUpdateInfo")
    for route, body in VLLMEndpoint.update_calls(UPDATE):
        assert route in routes
        assert set(body or {}) <= embedded(route)
        if route == "/update_weights":
            assert body is not None
            _check(body["update_info"], update_fields)
    with pytest.raises(WeightUpdateRejected, match="NCCL only"):
        VLLMEndpoint.init_body(INIT.model_copy(update={"backend": "gloo"}))


def test_sglang_generate_request_and_answer(sources: dict[str, ast.Module]) -> None:
    """``/generate`` takes ``GenerateReqInput`` and its contract gate (``api/v1`` ``GenerateRequest``); sampling params
    are ``api/v1`` ``SamplingParams``, which refuses unknown keys. The answer's fields the endpoint reads are the
    ones ``_handle_batch_output`` writes."""
    io_struct, api = sources["sglang/srt/managers/io_struct.py"], sources["sglang/api/v1/api_types.py"]
    request_fields = _fields(io_struct, "GenerateReqInput", _fields(io_struct, "BaseReq"))
    contract, sampling = _fields(api, "GenerateRequest"), _fields(api, "SamplingParams")
    for seed in (None, 3):
        body = SGLangEndpoint.generate_body([5, 6, 7], 4, 16, 0.8, 0.9, seed)
        _check(body, request_fields)
        _check(body, contract)
        for params in body["sampling_params"] if seed is not None else [body["sampling_params"]]:
            _check(params, sampling)
    seeded = SGLangEndpoint.generate_body([5, 6, 7], 2, 16, 0.8, 0.9, 3)
    assert seeded["input_ids"] == [[5, 6, 7]] * 2 and [p["sampling_seed"] for p in seeded["sampling_params"]] == [3, 4]
    generate = _routes(sources["sglang/srt/entrypoints/http_server.py"])["/generate"]
    assert "GenerateReqInput" in ast.unparse(generate.args)
    written = _function(sources["sglang/srt/managers/tokenizer_manager.py"], "TokenizerManager", "_handle_batch_output")
    for key in ("'output_ids'", "'meta_info'", "'finish_reason'", "'weight_version'"):
        assert key in written, key
    logprobs = _function(sources["sglang/srt/managers/tokenizer_manager.py"], "TokenizerManager",
                         "add_logprob_to_meta_info")
    assert "meta_info['output_token_logprobs']" in logprobs
    spans = ast.unparse(next(n for n in sources["sglang/srt/utils/weight_versions.py"].body
                             if isinstance(n, ast.FunctionDef) and n.name == "add_weight_versions_to_meta_info"))
    assert "meta_info['weight_versions']" in spans and all(f"'{k}'" in spans for k in ("version", "start", "end"))


def test_vllm_completion_request_and_answer(sources: dict[str, ast.Module]) -> None:
    """``/v1/completions`` with a token-id prompt: every field sent is ``CompletionRequest``'s (its base model allows
    extra fields, so a misspelt one would be ignored, not refused); the choice fields read back are
    ``CompletionResponseChoice``'s."""
    protocol = sources["vllm/entrypoints/openai/completion/protocol.py"]
    endpoint = VLLMEndpoint("http://vllm:8000")
    for seed, user in ((None, None), (3, "r/1")):
        body = endpoint.completion_body([5, 6, 7], 4, 16, 0.8, 0.9, seed, user)
        _check(body, _fields(protocol, "CompletionRequest"))
        assert body["prompt"] == [5, 6, 7] and body["return_token_ids"] and body["return_weight_versions"]
    assert "/v1/completions" in _routes(sources["vllm/entrypoints/openai/completion/api_router.py"])
    choice = _fields(protocol, "CompletionResponseChoice")
    assert {"text", "token_ids", "prompt_token_ids", "logprobs", "finish_reason", "weight_versions"} <= set(choice)
    assert "token_logprobs" in _fields(protocol, "CompletionLogProbs")
