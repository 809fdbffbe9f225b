"""The OpenAI-compatible HTTP endpoint (docs/reference.md, "HTTP API") as a Ray Serve application.

Each replica owns one ``Engine`` driven as a continuous batch by ``EngineLoop``; this module only translates
between OpenAI's wire format and engine requests/results. Entry points:

- ``make_app(config)``: the application for a ``Config`` (used by ``specbatch serve``): the replicas behind
  ``deploy.router``'s ingress;
- ``build_app(args)``: Serve's application builder, for ``serve run deploy.server:build_app config=FILE`` and
  a Serve config file's ``import_path`` (``args`` hold ``config`` and/or config fields, dotted or nested).

No ``from __future__ import annotations`` here: Serve's class-based FastAPI views need the route handlers'
annotations as real types (a string ``Request`` would be taken for a query parameter). Everything the
deployment's methods use is defined above it: the decorator snapshots the class when it is defined.
"""


import asyncio
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from pathlib import Path
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, SecretStr, ValidationError
from ray import serve
from ray.runtime_context import get_runtime_context
from ray.serve import Application
from starlette.exceptions import HTTPException

from decoding.config import Config, SamplingParams, load_config
from decoding.engine import Engine, GenerationResult
from decoding.engine import Request as EngineRequest
from decoding.engine.sequence import EngineError, input_bytes, render_messages
from decoding.model.loading import load_tokenizer, worker_threads
from decoding.model.lora import AdapterError
from decoding.params import RequestError, resolve_sampling
from decoding.stats import SpecDecodeStats
from decoding.verification.sampling import row_seed
from deploy import asgi, drain, gate
from deploy.detokenize import IncrementalText
from deploy.engine_loop import REPLICA_RUNTIME_ENV, Draining, EngineFailure, EngineLoop, Event, RequestRejected
from deploy.protocol import (
    MAX_CONTEXT,
    MAX_SEQUENCES,
    VERSION,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorDetail,
    ErrorResponse,
    GenerationRequest,
    LoadLoraAdapterRequest,
    Logprob,
    Metrics,
    ModelCard,
    ModelList,
    Prompt,
    PromptLogprobs,
    PromptTokensDetails,
    SpecDecodeMetrics,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UnloadLoraAdapterRequest,
    Usage,
    VersionResponse,
)
from frontend.logprobs import vllm_logprobs
from frontend.metrics import EngineMetrics, prometheus_backend, ray_backend
from frontend.resources import check_cluster
from frontend.tool_calls import ToolStream, ToolUse, openai_calls

log = logging.getLogger(__name__)

api = FastAPI(title="specbatch", description="OpenAI-compatible generation with speculative decoding")

# A body larger than this is parsed on the parse lane, one body at a time, off the event loop: the JSON parser holds
# the GIL throughout (~0.1 s per 10 MB of token ids), so /health waits at most one such parse.
LARGE_BODY_BYTES = 1 << 20
_PARSE_LANE = ThreadPoolExecutor(1, thread_name_prefix="parse")


# ---------------------------------------------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.detail = status, ErrorDetail(message=message, type=kind, param=param, code=code)


_error = gate.error


@api.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return _error(exc.status, exc.detail)


@api.exception_handler(RequestRejected)
async def _rejected(_: Request, exc: RequestRejected) -> JSONResponse:
    return _error(400, ErrorDetail(message=str(exc), type="invalid_request_error"))


@api.exception_handler(EngineFailure)
async def _engine_failure(_: Request, exc: EngineFailure) -> JSONResponse:
    return _error(503, ErrorDetail(message=str(exc), type="server_error"))


@api.exception_handler(Draining)
async def _draining(_: Request, exc: Draining) -> JSONResponse:
    return gate.unavailable(str(exc))


# The gate lives in its own module: the deployment class is shipped to replicas by value, globals included, so a
# module-level object here would be a different copy in its methods than in the middleware.
api.add_middleware(gate.GateMiddleware)


@api.exception_handler(HTTPException)
async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error(exc.status_code, ErrorDetail(message=str(exc.detail), type=kind))


@api.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error")
    return _error(500, ErrorDetail(message=f"internal error: {exc!r}", type="server_error"))


def max_body_values(max_context: int) -> int:
    """The most JSON values a body may hold: ``MAX_SEQUENCES`` prompts of a whole context's token ids (and as many
    values again for everything else); counted as its commas while it arrives, so that a body of ids beyond any
    valid request's is refused before it is parsed (each id parsed costs ~40 bytes of memory)."""
    return 2 * MAX_SEQUENCES * max_context


async def _json_body(request: Request, max_values: int) -> bytes:
    """The body, refused (before it is read whole) when larger than ``asgi.MAX_BODY_BYTES``, holding more than
    ``max_values`` JSON values (``max_body_values``) or not sent as JSON. A missing Content-Type is read as JSON, as
    FastAPI does."""
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(400, f"the body must be JSON sent as Content-Type: application/json, not {media_type}")
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"the body is larger than {asgi.MAX_BODY_BYTES} bytes")
    if declared.isdigit() and int(declared) > asgi.MAX_BODY_BYTES:
        raise too_large
    chunks, size, values = [], 0, 0
    async for chunk in request.stream():
        size += len(chunk)
        values += chunk.count(b",")  # an upper bound on the values: commas in strings count too
        if size > asgi.MAX_BODY_BYTES:
            raise too_large
        if values > max_values:
            raise ApiError(413, f"the body holds more than {max_values} JSON values: a request carries at most "
                                f"{MAX_SEQUENCES} prompts of the model's context in token ids")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, model: type[GenerationRequest], max_context: int) -> Any:
    """``raw`` validated as ``model``: a 400 naming the first field at fault."""
    try:
        return model.model_validate_json(raw, context={MAX_CONTEXT: max_context})
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        message = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        raise ApiError(400, message, param=param) from None


# ----------------------------------------------------------------------------------------- response shapes
def _totals(results: list[GenerationResult]) -> dict[str, Any]:
    """``usage`` and ``metrics`` of a response over all its choices."""
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(r.token_ids) for r in results)
    cached = PromptTokensDetails(cached_tokens=sum(r.num_cached_tokens for r in results))
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                  prompt_tokens_details=cached)
    return {"usage": usage, "metrics": _metrics(results)}


def _usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _prompt_tokens(event: Event) -> int:
    """A sequence's prompt length from its first event (its tokens carry it; a result has the prompt's ids)."""
    if isinstance(event, GenerationResult):
        return len(event.prompt_token_ids)
    return getattr(event, "num_prompt_tokens", None) or 0


def _metrics(results: list[GenerationResult]) -> Metrics:
    total = SpecDecodeStats.total(r.stats for r in results)  # the one definition (decoding.stats)
    return Metrics(speculative_decoding=SpecDecodeMetrics(**total.struct()))


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


Entries = list[dict[str, Any]]  # GenerationResult.logprobs: per token, its logprob and top alternatives


def _chat_logprobs(tokenizer: Any, entries: Entries | None) -> ChatLogprobs | None:
    if entries is None:
        return None

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = _token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[
        TokenLogprob(**top(e["token_id"], e["logprob"]).model_dump(),
                     top_logprobs=[top(a["token_id"], a["logprob"]) for a in e["top_logprobs"]])
        for e in entries
    ])


def _completion_logprobs(tokenizer: Any, entries: Entries | None, offset: int = 0) -> CompletionLogprobs | None:
    """``offset``: characters of the tokens before these (a stream's earlier chunks)."""
    if entries is None:
        return None
    tokens = [_token_text(tokenizer, e["token_id"]) for e in entries]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[e["logprob"] for e in entries],
        top_logprobs=[{_token_text(tokenizer, a["token_id"]): a["logprob"] for a in e["top_logprobs"]}
                      for e in entries],
        text_offset=offsets,
    )


def _prompt_logprobs(tokenizer: Any, entries: list[dict[str, Any] | None] | None) -> PromptLogprobs | None:
    """``GenerationResult.prompt_logprobs`` in vLLM's shape, its token ids as JSON's string keys."""
    positions = vllm_logprobs(entries, lambda ids: [_token_text(tokenizer, token) for token in ids])
    if positions is None:
        return None
    return [None if position is None else {str(token): Logprob(**entry) for token, entry in position.items()}
            for position in positions]


def _token_chars(tokenizer: Any, entries: Entries) -> int:
    return sum(len(_token_text(tokenizer, e["token_id"])) for e in entries)


class _Format(ABC):
    """How one endpoint shapes results: whole responses, stream chunks, and which field holds the input."""

    def __init__(self, prefix: str, input_field: str, model: str, tokenizer: Any = None,
                 request_id: str | None = None, token_ids: bool = False) -> None:
        """``request_id``: the body's (vLLM's), else a fresh one; ``token_ids``: choices carry their token ids
        (``return_token_ids``)."""
        self.id, self.input_field, self.model = f"{prefix}-{request_id or uuid.uuid4().hex}", input_field, model
        self.tokenizer = tokenizer  # for logprobs' token strings
        self.token_ids = token_ids
        self.created = int(time.time())

    def ids(self, ids: list[int] | None) -> list[int] | None:
        """``ids`` where the request asked for token ids, else None (left out of the choice)."""
        return list(ids) if self.token_ids and ids is not None else None

    def _fields(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    @abstractmethod
    def response(self, results: list[GenerationResult]) -> BaseModel: ...

    @abstractmethod
    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: Entries | None = None, offset: int = 0, prompt_logprobs: Entries | None = None,
              usage: Usage | None = None, token_ids: list[int] | None = None,
              stop_reason: int | str | None = None) -> BaseModel:
        """One stream chunk; ``logprobs``: the entries of the tokens it carries, ``offset`` their first
        character in the choice's token text; ``prompt_logprobs``: the choice's (with the chunk that ends it);
        ``usage``: the choice's so far (vLLM's ``continuous_usage_stats``); ``token_ids``: the ids of the tokens
        it carries (``return_token_ids``); ``stop_reason``: with the chunk that ends the choice."""

    def opening_chunks(self, usages: list[Usage | None], prompts: list[list[int]]) -> list[BaseModel]:
        """The chunks before any token, one per choice (``usages``: each one's, or None; ``prompts``: each one's
        prompt token ids, sent where asked for)."""
        return []

    @abstractmethod
    def usage_chunk(self, results: list[GenerationResult]) -> BaseModel: ...


class _CompletionFormat(_Format):
    def __init__(self, model: str, tokenizer: Any = None, echo: bool = False, request_id: str | None = None,
                 token_ids: bool = False) -> None:
        super().__init__("cmpl", "prompt", model, tokenizer, request_id, token_ids)
        self.echo = echo  # each choice's text starts with its prompt's (vLLM's, OpenAI's echo)

    def response(self, results: list[GenerationResult]) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text=r.prompt + r.text if self.echo else r.text, finish_reason=r.finish_reason,
                             stop_reason=r.stop_reason, logprobs=_completion_logprobs(self.tokenizer, r.logprobs),
                             prompt_logprobs=_prompt_logprobs(self.tokenizer, r.prompt_logprobs),
                             prompt_token_ids=self.ids(r.prompt_token_ids), token_ids=self.ids(r.token_ids))
            for i, r in enumerate(results)
        ]
        return CompletionResponse(**self._fields(), choices=choices, **_totals(results))

    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: Entries | None = None, offset: int = 0, prompt_logprobs: Entries | None = None,
              usage: Usage | None = None, token_ids: list[int] | None = None,
              stop_reason: int | str | None = None) -> CompletionResponse:
        choice = CompletionChoice(index=index, text=text or "", finish_reason=finish_reason, stop_reason=stop_reason,
                                  logprobs=_completion_logprobs(self.tokenizer, logprobs, offset),
                                  prompt_logprobs=_prompt_logprobs(self.tokenizer, prompt_logprobs),
                                  token_ids=self.ids(token_ids))
        return CompletionResponse(**self._fields(), choices=[choice], usage=usage)

    def opening_chunks(self, usages: list[Usage | None], prompts: list[list[int]]) -> list[CompletionResponse]:
        # vLLM sends a choice's prompt ids in its first chunk; completions have no role chunk, so one of their own.
        if not self.token_ids:
            return []
        return [CompletionResponse(**self._fields(), usage=usage, choices=[CompletionChoice(
            index=i, text="", prompt_token_ids=list(prompt), token_ids=[])])
            for i, (usage, prompt) in enumerate(zip(usages, prompts))]

    def usage_chunk(self, results: list[GenerationResult]) -> CompletionResponse:
        return CompletionResponse(**self._fields(), choices=[], **_totals(results))


class _ChatFormat(_Format):
    def __init__(self, model: str, tokenizer: Any = None, request_id: str | None = None,
                 token_ids: bool = False, echo: str = "", tools: ToolUse | None = None) -> None:
        super().__init__("chatcmpl", "messages", model, tokenizer, request_id, token_ids)
        self.echo = echo  # the text each choice's content starts with (vLLM's chat echo)
        self.tools = tools  # how each choice's text becomes tool calls
        self.streams: dict[int, ToolStream] = {}

    def _message(self, result: GenerationResult) -> tuple[AssistantMessage, str]:
        """A choice's message and finish reason: with tools, the calls its text holds (``tool_calls`` when any)."""
        if self.tools is None:
            return AssistantMessage(content=self.echo + result.text), result.finish_reason
        parsed = self.tools.extract(result.text)
        calls = [ToolCall(**call) for call in openai_calls(parsed.calls)]
        content = self.echo + (parsed.content or "") if parsed.content or self.echo else None
        finish = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        return AssistantMessage(content=content, tool_calls=calls), finish

    def response(self, results: list[GenerationResult]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(index=i, message=message, finish_reason=finish,
                       stop_reason=r.stop_reason, logprobs=_chat_logprobs(self.tokenizer, r.logprobs),
                       token_ids=self.ids(r.token_ids))
            for i, r in enumerate(results) for message, finish in [self._message(r)]
        ]
        prompt_logprobs = _prompt_logprobs(self.tokenizer, results[0].prompt_logprobs) if results else None
        prompt_ids = self.ids(results[0].prompt_token_ids) if results else None
        return ChatCompletionResponse(**self._fields(), choices=choices, prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=prompt_ids, **_totals(results))

    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: Entries | None = None, offset: int = 0, prompt_logprobs: Entries | None = None,
              usage: Usage | None = None, token_ids: list[int] | None = None,
              stop_reason: int | str | None = None, prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
        delta = ChatDelta(role="assistant" if role else None, content=text)
        if self.tools is not None:  # text held back while it may be a call; calls as OpenAI's deltas
            stream = self.streams.setdefault(index, self.tools.stream())
            content, calls = stream.push(text or "", final=finish_reason is not None)
            delta.content, delta.tool_calls = (content or None) if calls else content, calls or None
            if finish_reason == "stop" and stream.called:
                finish_reason = "tool_calls"
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, stop_reason=stop_reason,
                                 logprobs=_chat_logprobs(self.tokenizer, logprobs), token_ids=self.ids(token_ids))
        return ChatCompletionChunk(**self._fields(), choices=[choice], usage=usage,
                                   prompt_logprobs=_prompt_logprobs(self.tokenizer, prompt_logprobs),
                                   prompt_token_ids=self.ids(prompt_token_ids))

    def opening_chunks(self, usages: list[Usage | None], prompts: list[list[int]]) -> list[ChatCompletionChunk]:
        # OpenAI announces the role first; vLLM sends the prompt's ids with it.
        return [self.chunk(i, "", None, role=True, usage=usage, token_ids=[], prompt_token_ids=prompt)
                for i, (usage, prompt) in enumerate(zip(usages, prompts))]

    def usage_chunk(self, results: list[GenerationResult]) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._fields(), choices=[], **_totals(results))


def _sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def _prompt_input(prompt: Prompt) -> dict[str, Any]:
    """An engine request's input for one completions prompt: its text, or its token ids."""
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}


class _StreamUsage:
    """A stream's usage: the final chunk's (``include_usage``), and with vLLM's ``continuous_usage_stats`` every
    chunk's, its choice's prompt tokens and the tokens it has generated so far."""

    def __init__(self, prompt_tokens: list[int], final: bool, continuous: bool) -> None:
        self.prompt_tokens, self.final, self.continuous = prompt_tokens, final, continuous
        self.generated = [0] * len(prompt_tokens)

    def so_far(self, index: int) -> Usage | None:
        return _usage(self.prompt_tokens[index], self.generated[index]) if self.continuous else None


async def _replay(
    head: list[tuple[int, Event]], rest: AsyncGenerator[tuple[int, Event], None]
) -> AsyncGenerator[tuple[int, Event], None]:
    async with aclosing(rest):
        for item in head:
            yield item
        async for item in rest:
            yield item


# -------------------------------------------------------------------------------------------------- deployment
class OpenAIReplica:
    """One replica: its engine, and the routes of ``api`` (Serve's class-based views: each route finds the replica's
    instance through the replica context, so the routes also serve ``forward`` in a replica with no HTTP of its
    own)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # Ray starts replicas with OMP_NUM_THREADS=1: a CPU replica takes its num_cpus, else its share of the node.
        threads = worker_threads(config.num_cpus, config.concurrency_range[1])
        # vLLM: served_model_name names the model in /v1/models and requests; else its path (or the path's name).
        self.model_id = config.served_model_name or config.model
        self.model_names = {self.model_id} if config.served_model_name else {config.model, Path(config.model).name}
        # vLLM's metrics, recorded as the engine steps: Ray's metrics export (all replicas) and this replica's own
        # GET /metrics.
        self.registry = prometheus_client.CollectorRegistry()
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = EngineMetrics([ray_backend(replica_id), prometheus_backend(self.registry)], self.model_id)
        self.loop = EngineLoop(lambda: Engine(config), threads, self.metrics, config.limits.step_timeout_s)
        self.metrics.bind(self.loop.engine.max_context)  # the token-count histograms' buckets end at the context
        # The engine thread tokenizes with its own tokenizer; streaming decodes on the event loop with this one.
        # /tokenize and /detokenize use the runner's preparing threads and their tokenizers (EngineRunner.in_pool).
        self.tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        gate.GATE.api_key = config.api_key.get_secret_value().encode() if config.api_key else None
        gate.GATE.metrics_require_api_key = config.metrics_require_api_key
        drain.watch(serve.get_replica_context().app_name, get_runtime_context().get_actor_id(),
                    start=self._start_draining, busy=lambda: gate.GATE.in_flight, end=self._end_requests)

    def _start_draining(self) -> None:
        gate.GATE.draining = True

    def _end_requests(self, grace: float) -> None:
        self.loop.end_all(Draining(f"the server is shutting down and this request did not finish within its "
                                   f"{grace:g} s grace period"))

    def check_health(self) -> None:
        """Serve's periodic probe: raising marks the replica unhealthy, so Serve replaces it."""
        self.loop.check_health()

    @api.get("/health")
    async def health(self) -> Any:
        self.loop.check_health()
        if gate.GATE.draining:
            return gate.unavailable("the server is shutting down")
        engine = self.loop.engine
        # Counters let a client see batching at work: concurrent requests share steps.
        return {
            "status": "ok", "steps": self.loop.steps, "running": len(engine.running), "waiting": len(engine.waiting),
        }

    @api.get("/ping")
    @api.post("/ping")
    async def ping(self) -> Any:
        """vLLM's (SageMaker's) liveness route: /health's answer."""
        return await self.health()

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        """This replica's vLLM metrics in Prometheus' text format (all replicas: Ray's metrics export). Open without
        the API key unless ``metrics_require_api_key`` (deploy.gate)."""
        text = prometheus_client.generate_latest(self.registry)
        return Response(text, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @api.get("/version")
    async def version(self) -> dict[str, Any]:
        return VersionResponse(version=VERSION).model_dump()

    @api.post("/tokenize")
    async def tokenize(self, raw: Request) -> dict[str, Any]:
        """vLLM's: a prompt, or messages rendered with the chat template, as the model's token ids. Bounded as a
        generation's input (``limits.max_prompt_bytes``, the context), tokenized in a worker thread."""
        body: TokenizeRequest = await self._parse(raw, TokenizeRequest)
        if (problem := body.problem()) is not None:
            raise ApiError(400, problem[0], param=problem[1])
        field = "prompt" if body.messages is None else "messages"
        # vLLM's defaults: a prompt gets the tokenizer's special tokens, messages only those of the chat template.
        add_special_tokens = body.messages is None if body.add_special_tokens is None else body.add_special_tokens
        if body.messages is None:
            request = EngineRequest(id="tokenize", prompt=body.prompt)
        else:
            try:
                rendering = body.chat_options().request_fields(self.config)
            except RequestError as exc:
                raise ApiError(400, str(exc), param="chat_template") from None
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            request = EngineRequest(id="tokenize", messages=[m.rendered() for m in body.messages], tools=tools,
                                    **rendering)
        engine = self.loop.engine
        size = input_bytes(request)
        if size > engine.max_prompt_bytes:
            raise ApiError(400, f"the {field} has {size} bytes, more than limits.max_prompt_bytes "
                                f"({engine.max_prompt_bytes})", param=field)

        def work(tokenizer: Any) -> tuple[list[int], list[str] | None]:
            text = request.prompt if request.messages is None else render_messages(tokenizer, request)
            ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            return ids, tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

        try:
            ids, strs = await asyncio.wrap_future(self.loop.runner.in_pool(work, size))
        except EngineError as exc:
            raise ApiError(400, str(exc), param=field) from None
        if len(ids) > engine.max_context:  # vLLM's bound: the model's context
            raise ApiError(400, f"the {field} has {len(ids)} tokens, more than max_model_len ({engine.max_context})",
                           param=field)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_context, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    @api.post("/detokenize")
    async def detokenize(self, raw: Request) -> dict[str, Any]:
        """vLLM's: token ids (at most the context's, each in the vocabulary) as text, decoded in a worker thread."""
        body: DetokenizeRequest = await self._parse(raw, DetokenizeRequest)
        engine = self.loop.engine
        vocab = engine.loaded_target.config.vocab_size
        if len(body.tokens) > engine.max_context:
            raise ApiError(400, f"tokens has {len(body.tokens)} ids, more than max_model_len ({engine.max_context})",
                           param="tokens")
        if any(not 0 <= token < vocab for token in body.tokens):
            raise ApiError(400, f"token ids must lie in [0, {vocab})", param="tokens")
        text = await asyncio.wrap_future(self.loop.runner.in_pool(lambda tokenizer: tokenizer.decode(body.tokens), 0))
        return DetokenizeResponse(prompt=text).model_dump()

    def _cards(self) -> list[ModelCard]:
        """The base model's card, then each LoRA adapter's (vLLM's: ``parent`` the base, ``root`` its path)."""
        engine = self.loop.engine
        cards = [ModelCard(id=self.model_id, root=self.config.model, max_model_len=engine.max_context)]
        if engine.adapters is not None:
            cards += [ModelCard(id=name, root=path, parent=self.model_id, max_model_len=engine.max_context)
                      for name, path in sorted(engine.adapters.loaded().items())]
        return cards

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return ModelList(data=self._cards()).model_dump()

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        adapter = await self._resolve_model(model_id)
        card = next(card for card in self._cards() if card.id == (adapter or self.model_id))
        return card.model_dump()

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, raw: Request) -> Response:
        """vLLM's: adapter ``lora_name`` read from ``lora_path`` (a folder or URI) and served from now on, where the
        configuration allows runtime updates (``lora.allow_runtime_lora_updating``)."""
        adapters = self._runtime_adapters()
        body: LoadLoraAdapterRequest = await self._parse(raw, LoadLoraAdapterRequest)
        if body.lora_name in self.model_names:
            raise ApiError(400, f"`{body.lora_name}` is the base model's name", param="lora_name")
        try:
            await asyncio.to_thread(adapters.add, body.lora_name, body.lora_path)
        except AdapterError as exc:
            raise ApiError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, raw: Request) -> Response:
        """vLLM's: adapter ``lora_name`` no longer served (requests running under it finish)."""
        adapters = self._runtime_adapters()
        body: UnloadLoraAdapterRequest = await self._parse(raw, UnloadLoraAdapterRequest)
        try:
            adapters.remove(body.lora_name)
        except AdapterError as exc:
            raise ApiError(404, str(exc), param="lora_name", code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _runtime_adapters(self) -> Any:
        engine = self.loop.engine
        if engine.adapters is None or not self.config.lora.allow_runtime_lora_updating:
            raise ApiError(404, "runtime LoRA adapter updates are off: set lora.enable and "
                                "lora.allow_runtime_lora_updating (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
        return engine.adapters

    @api.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        body: CompletionRequest = await self._parse(raw, CompletionRequest)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (the prompt's entries would lead the choice's); "
                                "ask for prompt_logprobs instead", param="echo")
        sampling = self._sampling(body)
        # OpenAI's order: the n choices of the first prompt, then those of the next.
        requests = [self._request(body, sampling, choice, **_prompt_input(prompt))
                    for prompt in body.prompts for choice in range(body.n)]
        echo = None
        if body.echo and body.stream:  # a stream's first chunk of each choice starts with its prompt's text
            echo = await asyncio.wrap_future(self.loop.runner.in_pool(lambda tokenizer: [
                prompt if isinstance(prompt, str) else tokenizer.decode(prompt)  # as the engine decodes token ids
                for prompt in body.prompts for _ in range(body.n)], 0))
        return await self._generate(body, sampling, requests,
                                    _CompletionFormat(self._answering(body), self.tokenizer, echo=body.echo,
                                                      request_id=body.request_id, token_ids=body.return_token_ids),
                                    echo)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Response:
        body: ChatCompletionRequest = await self._parse(raw, ChatCompletionRequest)
        tools = body.tool_use()
        if tools is not None:
            try:
                tools = tools.parsed_by(self.config.tool_call_parser)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="tool_choice") from None
        sampling = self._sampling(body, tools)
        messages = [message.rendered() for message in body.messages]
        try:
            rendering = body.chat_options().request_fields(self.config)
        except RequestError as exc:
            raise ApiError(400, str(exc), param="chat_template") from None
        shown = {"tools": tools.tools} if tools is not None else {}
        requests = [self._request(body, sampling, choice, messages=messages, **rendering, **shown)
                    for choice in range(body.n)]
        echo = body.echoed
        return await self._generate(body, sampling, requests, _ChatFormat(
            self._answering(body), self.tokenizer, request_id=body.request_id, token_ids=body.return_token_ids,
            echo=echo, tools=tools), [echo] * body.n if echo and body.stream else None)

    # ------------------------------------------------------------------------------------------- internals
    async def _parse(self, request: Request, model: type[GenerationRequest]) -> Any:
        """The request's body as ``model``, read within the body bounds; a large one parsed on the parse lane."""
        max_context = self.loop.engine.max_context
        raw = await _json_body(request, max_body_values(max_context))
        if len(raw) > LARGE_BODY_BYTES:
            body = await asyncio.get_running_loop().run_in_executor(_PARSE_LANE, _parse, raw, model, max_context)
        else:
            body = _parse(raw, model, max_context)
        if getattr(body, "model", None) is not None:
            adapter = await self._resolve_model(body.model)
            if isinstance(body, GenerationRequest):
                body._lora = adapter
        return body

    def _answering(self, body: GenerationRequest) -> str:
        """The model a response names: the adapter asked for, else the served model."""
        return body.model if body._lora is not None and body.model else self.model_id

    def _sampling(self, body: GenerationRequest, tools: ToolUse | None = None) -> SamplingParams:
        """The body's sampling fields over the configured ones, with every bound (decoding.params, as for the
        pipeline's rows): nothing that passes can fail in an engine step. ``n`` is checked here, each choice being
        an engine request of its own. ``tools``: their constraint added. A 400 naming the body's field otherwise."""
        engine = self.loop.engine
        fields = body.sampling() if tools is None else tools.sampling(body.sampling())
        try:
            return resolve_sampling(fields, self.config.sampling, engine.target.config.vocab_size,
                                    engine.eos_ids, fan_out=True)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=body.param(exc.param)) from None

    async def _resolve_model(self, name: str) -> str | None:
        """The LoRA adapter ``name`` names (None: the base model): an adapter's name, or Ray Serve LLM's
        ``base_model_id:adapter``. An unknown model, or an adapter that cannot be read, is OpenAI's 404."""
        if name in self.model_names:
            return None
        adapters = self.loop.engine.adapters
        problem = f"this server serves '{self.model_id}'"
        if adapters is not None:
            base, colon, adapter = name.partition(":")
            adapter = adapter if colon and base in self.model_names else name
            try:
                await asyncio.to_thread(lambda: adapters.read(adapters.resolve(adapter)))
                return adapter
            except AdapterError as exc:
                problem = str(exc)
        # OpenAI's answer to an unknown model: 404, code model_not_found
        raise ApiError(404, f"The model `{name}` does not exist; {problem}", param="model", code="model_not_found")

    @staticmethod
    def _request(body: GenerationRequest, sampling: SamplingParams, choice: int, **inputs: Any) -> EngineRequest:
        one = {"n": 1}  # each choice is one engine sequence
        if body.seed is not None and body.n > 1:  # n seeded choices: n reproducible, different samples
            one["seed"] = row_seed(body.seed, str(choice))
        return EngineRequest(id=uuid.uuid4().hex, sampling=sampling.model_copy(update=one), **inputs,
                             **body.input_options())

    async def _generate(
        self, body: GenerationRequest, sampling: SamplingParams, requests: list[EngineRequest], fmt: _Format,
        echo: list[str] | None = None,
    ) -> Response:
        """``echo``: with a stream, the text each choice's first chunk starts with."""
        group = uuid.uuid4().hex  # one turn in the engine's fair admission for all of this body's sequences
        for request in requests:
            request.group = group
        if body.n > 1:  # each prompt's n choices: vLLM's parent request, for request_params_n
            for first in range(0, len(requests), body.n):
                self.metrics.parent([request.id for request in requests[first:first + body.n]])
        events = self.loop.generate(requests, stream=body.stream)
        head = await self._until_admitted(events, len(requests), fmt.input_field)
        if body.stream:
            prompt_tokens, prompts = [0] * len(requests), [[] for _ in requests]
            for index, event in head:  # the first event of every sequence
                prompt_tokens[index] = prompt_tokens[index] or _prompt_tokens(event)
                prompts[index] = prompts[index] or list(event.prompt_token_ids or [])
            usage = _StreamUsage(prompt_tokens, body.include_usage, body.continuous_usage)
            stop_ids = frozenset() if sampling.include_stop_str_in_output else frozenset(
                sampling.stop_ids(self.loop.engine.eos_ids))
            texts = [IncrementalText(self.tokenizer, sampling.stop, sampling.skip_special_tokens, stop_ids)
                     for _ in requests]
            chunks = self._stream(_replay(head, events), texts, fmt, usage, echo, prompts)
            return StreamingResponse(chunks, media_type="text/event-stream")
        results: list[GenerationResult] = [None] * len(requests)  # type: ignore[list-item]
        async with aclosing(_replay(head, events)) as stream:
            async for index, event in stream:
                if isinstance(event, GenerationResult):
                    results[index] = event
        # Built off the event loop: a response of 38 MB of logprobs took 5.2 s to build there, and /health and every
        # other request's stream waited for it.
        body = await asyncio.to_thread(lambda: fmt.response(results).model_dump_json().encode())
        return Response(body, media_type="application/json")

    @staticmethod
    async def _until_admitted(
        events: AsyncGenerator[tuple[int, Event], None], count: int, input_field: str
    ) -> list[tuple[int, Event]]:
        """Events up to the first of every sequence, so that a request the engine rejects is a 400 even when
        streaming (before any response header is sent)."""
        head: list[tuple[int, Event]] = []
        seen: set[int] = set()
        try:
            async for index, event in events:
                if isinstance(event, GenerationResult) and event.finish_reason == "error":
                    raise ApiError(400, event.error or "invalid request", param=input_field)
                head.append((index, event))
                seen.add(index)
                if len(seen) == count:
                    break
        except BaseException:
            await events.aclose()  # drops the other sequences' routes
            raise
        return head

    async def _stream(
        self, events: AsyncGenerator[tuple[int, Event], None], texts: list[IncrementalText], fmt: _Format,
        usage: _StreamUsage, echo: list[str] | None = None, prompts: list[list[int]] | None = None,
    ) -> AsyncIterator[str]:
        """``texts``: each choice's detokenizer, as its sampling parameters say; ``prompts``: each choice's prompt token
        ids (its first chunk carries them, with ``return_token_ids``)."""
        count = len(texts)
        # With return_token_ids, each chunk carries the ids of the tokens that came since the last one it sent.
        received: list[list[int]] = [[] for _ in range(count)]
        ids_sent = [0] * count
        # Logprob entries go out with the chunk that carries their text (a token's text may be held back), the
        # last ones with the final chunk, from the result (which a stop string may have cut short).
        pending: list[Entries] = [[] for _ in range(count)]
        sent, offsets = [0] * count, [0] * count
        results: list[GenerationResult] = []
        # echo: the prompt's text leads the first chunk of each choice (vLLM sends it with the first tokens' text).
        leads = list(echo) if echo is not None else [""] * count
        for chunk in fmt.opening_chunks([usage.so_far(i) for i in range(count)], prompts or [[]] * count):
            yield _sse(chunk)
        try:
            async with aclosing(events):  # a client that goes away closes this, releasing the engine routes
                async for index, event in events:
                    if isinstance(event, GenerationResult):
                        results.append(event)
                        usage.generated[index] = len(event.token_ids)
                        rest = None if event.logprobs is None else event.logprobs[sent[index]:]
                        text, leads[index] = leads[index] + texts[index].finish(event.text), ""
                        yield _sse(fmt.chunk(index, text, event.finish_reason, logprobs=rest, offset=offsets[index],
                                             prompt_logprobs=event.prompt_logprobs, usage=usage.so_far(index),
                                             token_ids=event.token_ids[ids_sent[index]:],
                                             stop_reason=event.stop_reason))
                        continue
                    usage.generated[index] += len(event)
                    pending[index] += event.logprobs or []
                    if fmt.token_ids:
                        received[index] += event
                    delta = texts[index].push(event)
                    if delta or leads[index]:
                        delta, leads[index] = leads[index] + delta, ""
                        entries = pending[index] if event.logprobs is not None else None
                        yield _sse(fmt.chunk(index, delta, None, logprobs=entries, offset=offsets[index],
                                             usage=usage.so_far(index), token_ids=received[index][ids_sent[index]:]))
                        ids_sent[index] = len(received[index])
                        sent[index] += len(pending[index])
                        offsets[index] += _token_chars(self.tokenizer, pending[index])
                        pending[index] = []
            if usage.final:
                yield _sse(fmt.usage_chunk(results))
        except (EngineFailure, Draining, RequestRejected) as exc:  # the status line is sent: report in-band
            kind = "invalid_request_error" if isinstance(exc, RequestRejected) else "server_error"
            yield _sse(ErrorResponse(error=ErrorDetail(message=str(exc), type=kind)))
        yield _sse("[DONE]")

    # ------------------------------------------------------- through a DeploymentHandle (deploy.router)
    async def forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
                      ) -> AsyncIterator[dict[str, Any] | bytes]:
        """This replica's HTTP API called in-process by the router (``deploy.router``): the response's start (status,
        headers, the body sent with them), then the rest of its body as it is sent (``asgi.call``). Called with
        ``stream=True``."""
        async for item in asgi.call(api, method, path, headers, body):
            yield item

    async def cards(self) -> list[dict[str, Any]]:
        return [card.model_dump() for card in self._cards()]


# The one-model application's deployment: the replica class with ``api`` as its HTTP ingress.
OpenAIServer = serve.deployment(serve.ingress(api)(OpenAIReplica), name="OpenAIServer")
# A model of a several-model application (deploy.router): the same replicas, reached through DeploymentHandles
# (Serve gives one deployment of an application HTTP).
ModelServer = serve.deployment(OpenAIReplica, name="ModelServer")


# -------------------------------------------------------------------------------------------------- builders
def deployment_options(config: Config) -> dict[str, Any]:
    """Replicas (fixed, or autoscaled within ``concurrency: [min, max]``) and GPUs per replica from the config."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": config.num_gpus, "runtime_env": REPLICA_RUNTIME_ENV},
        # Requests wait in the engine's queue rather than in Serve's: a request Serve holds back waits for a slot
        # behind every stream, /health included (over 10 s under 200 concurrent streams with 64 slots).
        "max_ongoing_requests": max(1024, 4 * config.batch_size),
        # Serve's own drain (serve run, Serve config files); specbatch serve drains first (deploy.drain).
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": drain.SHUTDOWN_WAIT_LOOP_S,
    }
    if isinstance(config.concurrency, int):
        options["num_replicas"] = config.concurrency
    else:
        low, high = config.concurrency
        options["autoscaling_config"] = {
            "min_replicas": low, "initial_replicas": low, "max_replicas": high,
            "target_ongoing_requests": config.batch_size,
        }
    return options


def make_app(config: Config, routed: bool = True) -> Application:
    """The application: the model's replicas (deployment ``OpenAIServer``) behind ``deploy.router``'s ingress, which
    turns a replica that dies mid-request into OpenAI-shaped 503s (Serve's proxy alone answers a plain-text 500 and
    cuts a stream short); ``routed=False``: the replicas are the HTTP ingress themselves. ``api_key`` unset in
    ``config`` comes from ``SPECBATCH_API_KEY`` or ``VLLM_API_KEY`` here, where the command runs (replicas may run
    on other nodes)."""
    if config.api_key is None:
        key = gate.env_api_key()
        if key is not None:
            config = config.model_copy(update={"api_key": SecretStr(key)})
    check_cluster(config, "replicas")
    options = deployment_options(config)
    if not routed:
        return OpenAIServer.options(**options).bind(config)
    from deploy.router import routed_app  # the router's module builds on this one

    model = ModelServer.options(name="OpenAIServer", **options).bind(config)
    key = config.api_key.get_secret_value() if config.api_key is not None else None
    return routed_app({config.served_model_name or config.model: model}, key,
                      max_ongoing_requests=max(4096, options["max_ongoing_requests"]))


def _flatten(args: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested builder args -> dotted overrides; non-strings as JSON, which the config loader reads as YAML."""
    flat: dict[str, str] = {}
    for key, value in args.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder: ``args`` may name a ``config`` file and override any config field."""
    fields = dict(args)
    return make_app(load_config(fields.pop("config", None), _flatten(fields)))

