"""The ingress in front of the models' replicas: Ray Serve LLM's ``build_openai_app`` for this engine, and the
one-model application of ``specbatch serve`` (``deploy.server.make_app``).

Each model is its own deployment of ``deploy.server.ModelServer`` (its replicas and autoscaling from its
configuration); an ingress deployment, ``OpenAIRouter``, hands each request to the replica of the model its body
names, through a DeploymentHandle: the replica runs it through its own HTTP API (``OpenAIReplica.forward``), so
every route, check and error of the replica's API applies unchanged, streams included. With several models the
router answers ``/v1/models``, ``/health``, ``/ping``, ``/version`` and ``/metrics`` itself; with one, only
``/v1/models`` and ``/version``, the rest being the replica's. A model's LoRA adapters are listed after it (their
``parent``) and named as Ray Serve LLM names them, ``base_model_id:adapter`` (with one model, by their own names too,
as vLLM does). An unknown model is a 404 naming the models served; a
replica that dies or cannot be reached is an OpenAI-shaped 503 (in a stream already answered: an error event, then
``[DONE]``), where Serve's proxy alone would answer a plain-text 500 and cut a stream short.

    serve run specbatch.serve:build_openai_app  (with a Serve config of Ray Serve LLM's form, or from Python:)
    serve.run(build_openai_app({"llm_configs": [LLMConfig(...), LLMConfig(...)]}))
"""

import re
from collections.abc import AsyncIterator
from typing import Any

import prometheus_client
import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from decoding.config import Config
from deploy import asgi, gate
from deploy.drain import SHUTDOWN_WAIT_LOOP_S
from deploy.llm_config import LLMConfig, ServingArgs
from deploy.protocol import VERSION, ErrorDetail, ErrorResponse, ModelList, VersionResponse
from frontend.resources import check_cluster

router_api = FastAPI(title="specbatch", description="OpenAI-compatible generation with speculative decoding")
router_api.add_middleware(gate.GateMiddleware)


def _error(status: int, message: str, kind: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return gate.error(status, ErrorDetail(message=message, type=kind, code=code, param=param))


class _Families:
    """Parsed metric families as a collector, for ``prometheus_client`` to write (label values escaped as its text
    format requires: a model named with a quote or a line break stays one label value)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _merged_metrics(texts: list[str]) -> bytes:
    """Several replicas' Prometheus texts as one exposition: each family once, the samples of all (their
    ``model_name`` labels tell them apart)."""
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(family.samples)
    return prometheus_client.generate_latest(_Families(list(families.values())))  # type: ignore[arg-type]


# Defined above the router: Serve ships the deployment class with the module's globals as they were when it was
# decorated.
def _model_of(body: bytes) -> str | None:
    """The ``model`` a request body names (None: none). Parsed as the replicas parse bodies (pydantic's JSON parser,
    which bounds nesting without recursing in Python): ``ValueError`` for a body that is not JSON."""
    parsed = pydantic_core.from_json(body) if body else None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def _relayed(start: asgi.ResponseStart) -> dict[str, str]:
    """A replica's response headers, as the router's response sends them (its own framing)."""
    return {k: v for k, v in start["headers"] if k.lower() not in ("content-length", "transfer-encoding")}


@serve.deployment
@serve.ingress(router_api)
class OpenAIRouter:
    def __init__(self, models: dict[str, DeploymentHandle], api_key: str | None) -> None:
        self.models = models
        # Each model's streaming handle, made once: a request only calls it (options() builds a new handle).
        self.streams = {name: handle.options(stream=True) for name, handle in models.items()}
        # The model whose replica answers /health, /ping and /metrics itself (its engine's state), when only one.
        self.only = next(iter(models)) if len(models) == 1 else None
        gate.GATE.api_key = api_key.encode() if api_key else None

    # -------------------------------------------------------------------------------- answered here
    @router_api.get("/health")
    async def health(self, request: Request) -> Any:
        if self.only is not None:
            return await self._forward(request, self.only, "/health")
        return {"status": "ok", "models": sorted(self.models)}

    @router_api.api_route("/ping", methods=["GET", "POST"])
    async def ping(self, request: Request) -> Any:
        if self.only is not None:
            return await self._forward(request, self.only, "/ping")
        return Response(status_code=200)

    @router_api.get("/version")
    async def version(self) -> Any:
        return VersionResponse(version=VERSION).model_dump()

    @router_api.get("/v1/models")
    async def list_models(self) -> Any:
        try:
            cards = [card for handle in self.models.values() for card in await handle.cards.remote()]
        except Exception as exc:  # a replica died, or none could be reached
            return gate.unavailable(f"a model's replica is unavailable: {type(exc).__name__}")
        return ModelList(data=cards).model_dump()

    @router_api.get("/v1/models/{model_id:path}")
    async def get_model(self, model_id: str) -> Any:
        base = self.only or self._model_of_name(model_id)  # one model: its replica knows its adapters' names
        if base is None:
            return self._unknown(model_id)
        try:
            cards = await self.models[base].cards.remote()
            adapter = model_id.partition(":")[2] if model_id.startswith(f"{base}:") else model_id
            card = next((card for card in cards if card["id"] in (model_id, adapter)), None)
            return card if card is not None else self._unknown(model_id)
        except Exception as exc:
            return gate.unavailable(f"the replica of `{model_id}` is unavailable: {type(exc).__name__}")

    @router_api.get("/metrics")
    async def metrics(self, request: Request) -> Any:
        """The models' vLLM metrics, one replica of each (all replicas: Ray's metrics export)."""
        if self.only is not None:
            return await self._forward(request, self.only, "/metrics")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() == "authorization"]
        texts = []
        try:
            for handle in self.streams.values():
                start, *rest = [item async for item in handle.forward.remote("GET", "/metrics", headers, b"")]
                body = b"".join([start["body"], *rest])
                if start["status"] != 200:  # e.g. 401: the replicas' metrics_require_api_key, without the key
                    return Response(body, status_code=start["status"], headers=_relayed(start))
                texts.append(body.decode())
        except Exception as exc:
            return gate.unavailable(f"a model's replica is unavailable: {type(exc).__name__}")
        return Response(_merged_metrics(texts), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------------------ handed to a model
    @router_api.api_route("/{path:path}", methods=["GET", "POST"])
    async def route(self, request: Request, path: str) -> Any:
        body = await request.body()
        if len(body) > asgi.MAX_BODY_BYTES:
            return _error(413, f"the request body is larger than {asgi.MAX_BODY_BYTES} bytes", "invalid_request_error")
        if self.only is not None:  # its replica judges the body's `model` (a model's path names it too)
            return await self._forward(request, self.only, f"/{path}", body)
        try:
            name = _model_of(body)
        except ValueError as exc:  # as the replicas answer a body that is not JSON, or nests past the parser's bound
            return _error(400, f"body: Invalid JSON: {exc}", "invalid_request_error")
        if name is None:
            return _error(400, f"`model` is required: this server serves {sorted(self.models)}",
                          "invalid_request_error", param="model")
        base = self._model_of_name(name)
        if base is None:
            return self._unknown(name)
        return await self._forward(request, base, f"/{path}", body)

    def _model_of_name(self, name: str) -> str | None:
        """The model a request's ``model`` names: itself, or for Ray Serve LLM's ``base_model_id:adapter`` (a LoRA
        adapter of that model, which its replica resolves) the base; None: no model served."""
        if name in self.models:
            return name
        base = name.partition(":")[0]
        return base if ":" in name and base in self.models else None

    async def _forward(self, request: Request, name: str, path: str, body: bytes = b"") -> Any:
        """``request`` answered by a replica of model ``name``, as ``path`` under the app's route prefix."""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        target = path + (f"?{request.url.query}" if request.url.query else "")
        stream = self.streams[name].forward.remote(request.method, target, headers, body)
        try:
            start = await stream.__anext__()
        except StopAsyncIteration:
            return _error(502, f"the replica of `{name}` ended the request without answering", "server_error")
        except Exception as exc:  # the replica died, or none could be reached
            return gate.unavailable(f"the replica of `{name}` is unavailable: {type(exc).__name__}")
        headers = _relayed(start)
        if start["complete"]:
            return Response(start["body"], status_code=start["status"], headers=headers)
        return StreamingResponse(self._rest(start["body"], stream, name), status_code=start["status"],
                                 headers=headers)

    @staticmethod
    async def _rest(first: bytes, stream: Any, name: str) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in stream:
                yield chunk
        except Exception as exc:  # the replica died mid-response: the status line is sent, report in-band
            error = ErrorResponse(error=ErrorDetail(
                message=f"the replica of `{name}` failed during the response: {type(exc).__name__}",
                type="server_error", code="service_unavailable"))
            yield f"data: {error.model_dump_json()}\n\ndata: [DONE]\n\n".encode()

    def _unknown(self, name: str) -> JSONResponse:
        return _error(404, f"The model `{name}` does not exist; this server serves {sorted(self.models)}",
                      "invalid_request_error", code="model_not_found", param="model")


def _deployment_name(model_id: str) -> str:
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_.:-]", "_", model_id)


def _model_deployment(llm: LLMConfig, config: Config, key: str | None, ingress: bool = False) -> Application:
    """The model's replicas with the LLMConfig's deployment options, accelerator, resources and runtime_env;
    ``ingress``: the replicas serve HTTP themselves (``OpenAIServer``), else behind the router (``ModelServer``)."""
    # Here, where the application is built: the router's replicas import this module, and the model servers' module
    # would bring them torch and transformers (5 CPU-s and 430 MB a process to import).
    from deploy.engine_loop import REPLICA_RUNTIME_ENV
    from deploy.server import ModelServer, OpenAIServer, deployment_options

    if key and config.api_key is None:
        config = config.model_copy(update={"api_key": SecretStr(key)})
    options = llm.replica_options(deployment_options(config), REPLICA_RUNTIME_ENV)
    options.setdefault("name", _deployment_name(llm.model_id))
    return (OpenAIServer if ingress else ModelServer).options(**options).bind(config)


def _api_key(configs: list[LLMConfig]) -> str | None:
    """``SPECBATCH_API_KEY`` or ``VLLM_API_KEY`` where the app is built, else the first model's
    ``specbatch.api_key``."""
    key = gate.env_api_key()
    for llm in configs:
        given = llm.specbatch.get("api_key")
        key = key or (given.get_secret_value() if isinstance(given, SecretStr) else given)
    return key


def routed_app(models: dict[str, Application], api_key: str | None, **ingress_options: Any) -> Application:
    """The models' deployments behind one ``OpenAIRouter`` (options: ``ingress_options``)."""
    # The router only relays bytes: it reserves no CPU, so the models' replicas get the cluster's; stopping, it waits
    # for relays in flight as the replicas do.
    ingress = {"name": "OpenAiIngress", "num_replicas": 1, "max_ongoing_requests": 4096,
               "ray_actor_options": {"num_cpus": 0}, "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
               **ingress_options}
    return OpenAIRouter.options(**ingress).bind(models, api_key)


def build_openai_app(builder_config: dict[str, Any] | ServingArgs) -> Application:
    """Ray Serve LLM's ``build_openai_app``: ``{"llm_configs": [LLMConfig | dict | YAML path, ...],
    "ingress_deployment_config": {...}}`` -> one application serving every model by its ``model_id``. The API key,
    when set (``SPECBATCH_API_KEY`` or ``VLLM_API_KEY`` where this runs, or a model's ``specbatch.api_key``),
    guards the router and every model."""
    args = builder_config if isinstance(builder_config, ServingArgs) else ServingArgs.model_validate(builder_config)
    key = _api_key(args.llm_configs)
    configs = {llm.model_id: llm.engine_config() for llm in args.llm_configs}
    check_cluster(configs, "replicas")  # the models' replicas together, not each alone
    models = {llm.model_id: _model_deployment(llm, configs[llm.model_id], key) for llm in args.llm_configs}
    return routed_app(models, key, **args.ingress_deployment_config)


def build_llm_deployment(llm_config: LLMConfig | dict[str, Any]) -> Application:
    """Ray Serve LLM's ``build_llm_deployment``: one model's own app, without a router (its replicas are the
    HTTP ingress)."""
    llm = llm_config if isinstance(llm_config, LLMConfig) else LLMConfig.model_validate(llm_config)
    config = llm.engine_config()
    check_cluster(config, "replicas")
    return _model_deployment(llm, config, _api_key([llm]), ingress=True)
