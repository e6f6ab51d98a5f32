"""The FastAPI app, its lifespan and routes, and ``run_server`` (``axon serve``).

Life cycle:

    bind the socket -> uvicorn serves at once; /health answers 503 until the engine is ready
    engine ready    -> "axon serving MODEL at http://HOST:PORT"; /health 200
    SIGTERM/Ctrl-C  -> stop accepting; in-flight requests are aborted (finish_reason "abort");
                       the engine core is shut down; exit 0
    engine dies     -> /health 503 naming it at once and new requests 503; in-flight ones fail
                       with the engine's error; after a short grace the server exits 1, the
                       engine processes reaped (shutdown never waits on a dead or stopped core);
                       with --data-parallel-size N, any one core's death is the engine's
    engine stalls   -> /health 503 (engine_stalled) while no heartbeat came for
                       --engine-heartbeat-timeout; 200 again if it resumes
    multi-host      -> with --data-parallel-size-local L < --data-parallel-size N, /health
                       answers 503 until ranks L..N-1 have joined from their hosts (axon serve
                       --headless, axon/entrypoints/headless.py) and are ready; a remote core
                       silent for --engine-heartbeat-timeout is dead (no process here to watch)
    second signal   -> exit at once (uvicorn's force exit), whatever is still draining
    engine fails to start -> the error is logged; exit 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from types import FrameType
from typing import Any

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from axon.config import AxonConfig
from axon.engine.async_llm import AsyncLLM
from axon.entrypoints.openai import cli_args
from axon.entrypoints.openai.errors import OpenAIError, anthropic_error, from_exception, unavailable
from axon.entrypoints.openai.middleware import AuthMiddleware, BodyLimitMiddleware, is_anthropic_path
from axon.entrypoints.openai.protocol import (
    UNION_TAGS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CountTokensRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    MessagesRequest,
    ModelList,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ResponsesRequest,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from axon.entrypoints.openai.serving_chat import OpenAIServingChat
from axon.entrypoints.openai.serving_completion import OpenAIServingCompletion
from axon.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from axon.entrypoints.openai.serving_engine import Admission, ClientGone, ServingContext
from axon.entrypoints.openai.serving_messages import AnthropicServingMessages
from axon.entrypoints.openai.serving_models import OpenAIServingModels
from axon.entrypoints.openai.serving_responses import OpenAIServingResponses
from axon.entrypoints.openai.serving_score import OpenAIServingScore
from axon.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from axon.lora.request import LoRARequest
from axon.metrics.loggers import LoggingStatLogger
from axon.metrics.profiler import Profiler, parse_profiler_config
from axon.metrics.prometheus import PrometheusStatLogger, render_metrics
from axon.metrics.stats import StatLogger
from axon.startup import configure_logging
from axon.version import __version__

logger = logging.getLogger("axon.entrypoints.openai.api_server")

STAT_LOG_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default
DEAD_ENGINE_GRACE_S = 2.0  # /health answers 503 this long before the server exits
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5


@dataclass
class Servings:
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    tokenization: OpenAIServingTokenization
    models: OpenAIServingModels
    embedding: OpenAIServingEmbedding
    score: OpenAIServingScore
    responses: OpenAIServingResponses
    messages: AnthropicServingMessages
    ctx: ServingContext


class ServerState:
    """Everything the app holds between requests; the engine starts in the background."""

    def __init__(self, args: argparse.Namespace, config: AxonConfig, served_model_names: list[str]) -> None:
        self.args = args
        self.config = config
        self.served_model_names = served_model_names
        self.chat_template = cli_args.load_chat_template(args.chat_template)
        assert config.model_config.max_model_len is not None
        spec = config.speculative_config.speculative_config  # resolved: vLLM's keys, or None
        engine_indexes = list(range(config.parallel_config.data_parallel_size))
        self.prometheus = PrometheusStatLogger(
            served_model_names[0],
            max_model_len=config.model_config.max_model_len,
            engine_indexes=engine_indexes,
            cache_config_info=dataclasses.asdict(config.cache_config),
            num_speculative_tokens=spec["num_speculative_tokens"] if spec else 0,
            kv_connector=(config.kv_transfer_config.kv_transfer_config or {}).get("kv_connector"),
            max_lora=config.lora_config.max_loras if config.lora_config.enable_lora else None,
        )
        self.stat_loggers: list[StatLogger] = [self.prometheus]
        if not config.observability_config.disable_log_stats:
            self.stat_loggers += [LoggingStatLogger(i) for i in engine_indexes]  # one line per core
        self.shutdown_event = asyncio.Event()
        self.engine: AsyncLLM | None = None
        self.servings: Servings | None = None
        self.server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0
        self.tasks: list[asyncio.Task[Any]] = []

    # ---- life cycle ------------------------------------------------------------------------
    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.tasks.append(asyncio.create_task(self._start_engine()))

    async def _start_engine(self) -> None:
        try:
            self.engine = self._make_engine()
            await self.engine.start()
            for core in self.engine.cores:
                self.prometheus.record_num_blocks(core.num_blocks, engine_idx=core.index)
        except Exception as e:  # noqa: BLE001 (any start-up failure ends the server, with its reason)
            logger.error("the engine failed to start: %s", e)
            self.exit(1)
            return
        self.servings = self._make_servings(self.engine)
        host, port = self.args.host, self.args.port
        logger.info("axon serving %s at http://%s:%d", self.served_model_names[0], host, port)
        self.tasks.append(asyncio.create_task(self._supervise(self.engine)))
        self.tasks.append(asyncio.create_task(self._log_stats()))

    def _make_engine(self) -> AsyncLLM:
        # Generative and embedding models alike run in the engine-core process.
        return AsyncLLM(
            self.config,
            self.stat_loggers,
            self.chat_template,
            heartbeat_timeout_s=self.args.engine_heartbeat_timeout,
        )

    def _make_servings(self, engine: AsyncLLM) -> Servings:
        m, s = self.config.model_config, self.config.scheduler_config
        assert m.max_model_len is not None and m.model_path is not None
        ctx = ServingContext(
            engine=engine,  # type: ignore[arg-type]
            served_model_names=self.served_model_names,
            model_path=m.model_path,
            max_model_len=m.max_model_len,
            admission=Admission(
                s.max_num_seqs, self.args.max_waiting_requests, self.config.parallel_config.data_parallel_size
            ),
            shutdown_event=self.shutdown_event,
            log_requests=self.args.enable_log_requests,
            max_log_len=self.args.max_log_len,
            enable_auto_tool_choice=self.args.enable_auto_tool_choice,
            tool_call_parser=self.args.tool_call_parser,
            reasoning_parser=self.config.structured_outputs_config.reasoning_parser,
            trust_request_chat_template=self.args.trust_request_chat_template,
            lora_modules={
                name: LoRARequest(name, i, path)
                for i, (name, path) in enumerate(cli_args.lora_modules(self.args.lora_modules), 1)
            },
        )
        return Servings(
            OpenAIServingChat(ctx),
            OpenAIServingCompletion(ctx),
            OpenAIServingTokenization(ctx),
            OpenAIServingModels(ctx),
            OpenAIServingEmbedding(ctx),
            OpenAIServingScore(ctx),
            OpenAIServingResponses(ctx),
            AnthropicServingMessages(ctx),
            ctx,
        )

    async def _supervise(self, engine: AsyncLLM) -> None:
        await engine.watch_process()
        logger.error(
            "the engine is dead (%s); /health answers 503 and the server exits in %.0f s",
            engine.dead_error,
            DEAD_ENGINE_GRACE_S,
        )
        await asyncio.sleep(DEAD_ENGINE_GRACE_S)
        self.exit(1)

    async def _log_stats(self) -> None:
        while True:
            await asyncio.sleep(STAT_LOG_INTERVAL_S)
            for stat_logger in self.stat_loggers:
                stat_logger.log()

    def exit(self, code: int) -> None:
        self.exit_code = max(self.exit_code, code)
        self.begin_shutdown()
        if self.server is not None:
            self.server.should_exit = True

    def begin_shutdown(self) -> None:
        """Stop accepting and abort in-flight requests (thread- and signal-safe)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.shutdown_event.set)

    async def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.servings is not None:
            self.servings.ctx.prompt_pool.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            if self.engine.errored:  # a signal during the dead engine's grace: still a failure
                self.exit_code = max(self.exit_code, 1)
            await self.engine.shutdown()

    # ---- state for routes ------------------------------------------------------------------
    def health_problem(self) -> OpenAIError | None:
        """Why /health is not 200. A dead or stalled engine is named first, even while it is
        shutting the server down, so that a crash never reads as "loading" or "shutting down"."""
        if self.engine is not None and self.servings is not None:
            problem = self.engine.health_problem()
            if problem is not None:
                code, message = problem
                return unavailable(message, code)
        if self.shutdown_event.is_set():
            return unavailable("The server is shutting down.", "shutting_down")
        if self.servings is None:
            return unavailable("The model is still loading.", "model_not_ready")
        return None

    def require_servings(self, runner: str | None = None) -> Servings:
        """The servings, once the engine is ready; ``runner``: the endpoint's kind of model."""
        if self.servings is None:
            raise unavailable("The model is still loading; retry shortly.", code="model_not_ready")
        if runner is not None and runner != self.config.model_config.runner:
            what = "an embedding model (--runner pooling)" if runner == "pooling" else "a generative model"
            raise OpenAIError(
                f"This endpoint needs {what}; the served model runs as "
                f"--runner {self.config.model_config.runner}.",
                HTTPStatus.BAD_REQUEST,
                code="wrong_model_type",
            )
        return self.servings


class AxonServer(uvicorn.Server):
    """uvicorn, but a signal also aborts in-flight requests, and is not re-raised on exit
    (uvicorn re-raises it, which would end the process with the signal, not exit code 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            # uvicorn forces an exit only on a second SIGINT; a supervisor sends SIGTERM twice.
            logger.warning("received %s again: exiting without waiting for open connections", name)
            self.force_exit = True
        else:
            logger.info("received %s: aborting in-flight requests and shutting down", name)
        super().handle_exit(sig, frame)
        self.state.begin_shutdown()


# ---- the app ---------------------------------------------------------------------------------
def build_app(state: ServerState, args: argparse.Namespace) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.startup()
        yield
        await state.shutdown()

    # /openapi.json (generated from the protocol models) and /docs, as vLLM serves them.
    app = FastAPI(title="axon", version=__version__, lifespan=lifespan, redoc_url=None)
    app.state.axon = state
    _add_routes(app, state)
    _document_400_not_422(app)
    _add_error_handlers(app)
    # Starlette runs the last-added middleware first: CORS, then auth, then the body limit, so
    # that an unauthenticated client is refused before the server reads (buffers) its body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_size)
    key = cli_args.api_key(args)
    if key is not None:
        app.add_middleware(AuthMiddleware, api_key=key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    return app


# For the OpenAPI schema: the error body every endpoint may answer, and the SSE form of the
# generation endpoints (stream: true).
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)
}
_STREAMS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},  # "data: {chunk}" lines
}


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        problem = state.health_problem()
        return Response(status_code=HTTPStatus.OK) if problem is None else problem.response()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/load")
    async def load() -> JSONResponse:
        servings = state.servings
        return JSONResponse({"server_load": servings.ctx.admission.num_inflight_seqs if servings else 0})

    profiler_settings = parse_profiler_config(state.config.observability_config.profiler_config)
    if profiler_settings is not None:  # vLLM's routes, 404 without a profiler config
        front_profiler = Profiler(profiler_settings, "axon-api-server")

        @app.post("/start_profile")
        async def start_profile() -> Response:
            engine = state.require_servings().ctx.engine
            front_profiler.start()
            await engine.call_utility("start_profile")
            return Response(status_code=HTTPStatus.OK)

        @app.post("/stop_profile")
        async def stop_profile() -> JSONResponse:
            engine = state.require_servings().ctx.engine
            traces = [p for paths in await engine.call_utility("stop_profile") for p in paths]
            front = front_profiler.stop()
            return JSONResponse({"traces": traces + ([front] if front else [])})

    if state.config.model_config.enable_sleep_mode:

        @app.post("/sleep")
        async def sleep(level: int = 1) -> Response:
            engine = state.require_servings().ctx.engine
            try:
                await engine.sleep(level)
            except ValueError as e:
                raise OpenAIError(str(e), HTTPStatus.BAD_REQUEST, param="level") from None
            return Response(status_code=HTTPStatus.OK)

        @app.post("/wake_up")
        async def wake_up() -> Response:
            await state.require_servings().ctx.engine.wake_up()
            return Response(status_code=HTTPStatus.OK)

        @app.get("/is_sleeping")
        async def is_sleeping() -> JSONResponse:
            return JSONResponse({"is_sleeping": state.require_servings().ctx.engine.sleeping})

    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":  # vLLM's development routes

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            servings = state.require_servings()
            done = all(await servings.ctx.engine.call_utility("reset_prefix_cache"))
            if not done:
                raise OpenAIError(
                    "The prefix cache cannot be reset while requests hold KV blocks; retry when idle.",
                    HTTPStatus.CONFLICT,
                    code="prefix_cache_in_use",
                )
            return Response(status_code=HTTPStatus.OK)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(render_metrics(state.prometheus.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> Response:
        return _json(state.require_servings().models.show_available_models())

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMS)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await state.require_servings("generate").chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses", responses=_STREAMS)
    async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
        return await state.require_servings("generate").responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str) -> Response:
        return state.require_servings("generate").responses.retrieve(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERRORS)
    async def cancel_response(response_id: str) -> Response:
        return await state.require_servings("generate").responses.cancel(response_id)

    @app.post("/v1/messages", responses=_STREAMS)
    async def messages(request: MessagesRequest, raw_request: Request) -> Response:
        return await state.require_servings("generate").messages.create_message(request, raw_request)

    @app.post("/v1/messages/count_tokens", responses=_ERRORS)
    async def count_tokens(request: CountTokensRequest) -> Response:
        return await state.require_servings("generate").messages.count_tokens(request)

    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"):

        @app.post("/v1/load_lora_adapter", responses=_ERRORS)
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            servings = state.require_servings("generate")
            return Response(await servings.models.load_lora_adapter(request), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", responses=_ERRORS)
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            servings = state.require_servings("generate")
            return Response(servings.models.unload_lora_adapter(request), media_type="text/plain")

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_STREAMS)
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await state.require_servings("generate").completion.create_completion(request, raw_request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        servings = state.require_servings("pooling")
        return _json(await servings.embedding.create_embedding(request, raw_request))

    @app.post("/score", response_model=ScoreResponse, responses=_ERRORS)
    @app.post("/v1/score", response_model=ScoreResponse, responses=_ERRORS)
    async def score(request: ScoreRequest, raw_request: Request) -> Response:
        return _json(await state.require_servings("pooling").score.create_score(request, raw_request))

    @app.post("/rerank", response_model=RerankResponse, responses=_ERRORS)
    @app.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS)
    @app.post("/v2/rerank", response_model=RerankResponse, responses=_ERRORS)
    async def rerank(request: RerankRequest, raw_request: Request) -> Response:
        return _json(await state.require_servings("pooling").score.create_rerank(request, raw_request))

    @app.post("/pooling", response_model=PoolingResponse, responses=_ERRORS)
    async def pooling(request: EmbeddingRequest, raw_request: Request) -> Response:
        servings = state.require_servings("pooling")
        return _json(await servings.embedding.create_pooling(request, raw_request))

    @app.post("/classify", responses=_ERRORS)
    async def classify() -> Response:
        raise OpenAIError(
            "This server has no classification model: axon's pooling models are embedding models "
            "(use /v1/embeddings, /pooling, /score or /rerank).",
            HTTPStatus.BAD_REQUEST,
            code="wrong_model_type",
        )

    @app.post("/invocations", responses=_STREAMS)
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's route: the request goes where its body's shape says (messages: chat,
        prompt: completions, input: embeddings)."""
        return await _invoke(state, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: TokenizeRequest) -> Response:
        return _json(await state.require_servings().tokenization.tokenize(request))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _json(state.require_servings().tokenization.detokenize(request))


async def _invoke(state: ServerState, raw_request: Request) -> Response:
    try:
        body = await raw_request.json()
    except ValueError as e:
        raise OpenAIError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.")
    try:
        if "messages" in body:
            chat = ChatCompletionRequest.model_validate(body)
            return await state.require_servings("generate").chat.create_chat_completion(chat, raw_request)
        if "prompt" in body:
            completion = CompletionRequest.model_validate(body)
            return await state.require_servings("generate").completion.create_completion(
                completion, raw_request
            )
        if "input" in body:
            embedding = EmbeddingRequest.model_validate(body)
            servings = state.require_servings("pooling")
            return _json(await servings.embedding.create_embedding(embedding, raw_request))
    except pydantic.ValidationError as e:
        raise _validation_error(RequestValidationError(e.errors())) from None
    raise OpenAIError(
        "/invocations takes a chat (messages), a completion (prompt) or an embedding (input) request."
    )


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI's schema promises 422 for an invalid body; axon answers 400 with an OpenAI error
    (``_validation_error``), which every route already declares."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()  # built once and cached by FastAPI; the edits below are idempotent
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> Response:
        return _error_response(request, e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        return _error_response(request, _validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        message = str(e.detail)
        if e.status_code in (HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED):
            message = f"Invalid URL ({request.method} {request.url.path}): {e.detail}"
        code = HTTPStatus(e.status_code).phrase.lower().replace(" ", "_")
        return _error_response(request, OpenAIError(message, e.status_code, code=code))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> Response:  # the engine's death included
        return _error_response(request, from_exception(e))


def _error_response(request: Request, e: OpenAIError) -> Response:
    """An error in the shape of the API its path belongs to: Anthropic's on /v1/messages."""
    return anthropic_error(e) if is_anthropic_path(request.url.path) else e.response()


def _validation_error(e: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 as OpenAI's 400, naming the fields."""
    problems, param = [], None
    for err in e.errors():
        if err.get("type") == "json_invalid":
            return OpenAIError(f"The request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        loc = [str(part) for part in err.get("loc", ()) if part != "body" and part not in UNION_TAGS]
        where = ".".join(loc) or "body"
        param = param or (where if loc else None)
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return OpenAIError("Invalid request: " + "; ".join(problems), HTTPStatus.BAD_REQUEST, param=param)


# ---- entry point -----------------------------------------------------------------------------
def _bind_socket(config: uvicorn.Config) -> socket.socket:
    """``config.bind_socket()`` without its "Uvicorn running on ..." line, which users read as
    "ready" while the model is still loading ("axon serving MODEL at ..." says that)."""
    uvicorn_logger = logging.getLogger("uvicorn.error")

    def not_running_line(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Uvicorn running on")

    uvicorn_logger.addFilter(not_running_line)
    try:
        return config.bind_socket()
    finally:
        uvicorn_logger.removeFilter(not_running_line)


def run_server(args: argparse.Namespace, config: AxonConfig, served_model_names: list[str]) -> int:
    """Serve until a signal (exit 0) or an engine failure (exit 1)."""
    configure_logging("api-server")
    state = ServerState(args, config, served_model_names)
    app = build_app(state, args)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        timeout_keep_alive=5,
    )
    server = AxonServer(uv_config, state)
    state.server = server
    sock = _bind_socket(uv_config)  # bound before the engine loads; /health says 503 until ready
    logger.info(
        "listening on http://%s:%d; loading the model (/health answers 503 until ready)",
        *sock.getsockname()[:2],
    )
    asyncio.run(server.serve(sockets=[sock]))
    return state.exit_code
