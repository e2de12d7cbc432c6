"""`rmflow serve`: a reward model behind HTTP, for RL loops (PPO, GRPO) and anything else.

A Starlette app on uvicorn. The model loads, and every batch shape compiles, in a background
thread after the port is bound: ``GET /health`` answers 503 until then, 200 after. Scoring
requests are read and tokenized off the event loop, queued in the ``DynamicBatcher`` and
awaited; the device thread runs the batches. One model per process.

Endpoints (``rmflow/server/protocol.py`` reads their bodies, ``rmflow/server/responders.py``
writes their answers): ``POST /v1/score`` (native), ``POST /get_reward`` (OpenRLHF), ``POST
/classify``, ``/pooling`` (vLLM pooling, as verl calls it), ``/v1/embeddings`` (SGLang), ``GET /v1/model``, ``GET /health``, ``GET /metrics`` (Prometheus). With an API key, every
request must carry ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hmac
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rmflow.handlers import handler
from rmflow.schemas import jsontext
from rmflow.schemas.config import ServeConfig
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import SCORE_STD
from rmflow.schemas.kinds import kind_named
from rmflow.server.batcher import Closed, DynamicBatcher, QueueFull
from rmflow.server.monitor import RewardMonitor, sequence_tokens
from rmflow.server.prometheus import ServerMetrics
from rmflow.server.protocol import (
    RequestError,
    read_classify,
    read_embeddings,
    read_get_reward,
    read_native,
    read_pooling,
)
from rmflow.server.responders import (
    Responder,
    respond_classify,
    respond_embeddings,
    respond_get_reward,
    respond_native,
    respond_pooling,
)

log = logging.getLogger("rmflow.serve")
RETRY_AFTER_S = 1
SHUTDOWN_GRACE_S = 5.0
CLIENT_GONE = 499  # the status logged for a request whose client went away (nginx's convention; never sent)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (after its body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Service:
    """The model, its batcher and metrics; ``load`` runs once, in a background thread."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.rm = None
        self.batcher: DynamicBatcher | None = None
        self.shapes = None
        self.units = False  # the shapes of K-response units compiled and used (--response-units)
        self.error: str | None = None
        self.ready = threading.Event()
        self.max_length_source = ""
        self.startup_length = 0  # the batch shapes up to this length compiled at load, longer ones on first use
        self.cut_requests = 0  # requests answered 503 once a shutdown ran out of time
        self.disconnected = 0  # requests whose client went away before the answer (their items cancelled)
        self.metrics = ServerMetrics(lambda: self.batcher.depth if self.batcher else 0)
        self.monitor: RewardMonitor | None = None  # an outcome model's reward-hacking signals (--monitor-window)
        self.metrics.watch(lambda name: self.monitor.value(name) if self.monitor else math.nan)

    def load(self) -> None:
        from rmflow.scoring.api import RewardModel

        cfg = self.cfg
        rm = RewardModel.load(cfg.model, cfg.step, reward=cfg.reward)
        if cfg.max_length > rm.positions:
            raise RequestError(500, f"--max-length {cfg.max_length}: more than the model's {rm.positions} positions")
        # By default all the model can score; the batch shapes up to the length it was trained at
        # compile before serving, longer ones on first use
        rm.limit_length(cfg.max_length or rm.positions)
        self.max_length_source = "--max-length" if cfg.max_length else "the model's positions"
        self.startup_length = min(cfg.startup_length or rm.trained_max_length or rm.max_length, rm.max_length)
        if cfg.normalize and not (rm.normalization and rm.normalization.get("std")):
            raise RequestError(500, f"--normalize: {cfg.model} has no reward_normalization.json (for an ensemble: of "
                                    "the reward it scores with); run `rmflow eval --normalize` on it first")
        # --deterministic: one item a row, in the shapes every entry point uses (RewardModel.shapes)
        shapes = rm.shapes(cfg.max_batch_rows, cfg.token_budget, small_batches=not cfg.deterministic,
                           row_length=self.startup_length, deterministic=cfg.deterministic)
        scorer = handler(rm.kind, "scorer")
        # K-response records in units of compiled shapes: an outcome model's (a process model has none)
        self.units = uses_units(cfg) and kind_named(rm.kind).head.per_conversation
        scorer.warm_up(rm, shapes, self.units, self.startup_length)
        _ = rm.assistant_marker  # rendered once, before the first request
        self.rm, self.shapes = rm, shapes
        if cfg.monitor_window and kind_named(rm.kind).head.per_conversation:
            self.monitor = RewardMonitor(cfg.monitor_window, reference=rm.normalization,
                                         trained_length=rm.trained_max_length, log_every=cfg.monitor_log_every)
        self.batcher = DynamicBatcher(lambda batch: scorer.run(rm, batch, shapes), shapes.plan, group=scorer.group,
                                      token_budget=cfg.token_budget, max_wait_s=cfg.max_wait_ms / 1000,
                                      max_queue=cfg.max_queue, max_queue_wait_s=cfg.max_queue_wait_s or None,
                                      on_batch=self.metrics.batch)
        self.metrics.ready.set(1)
        self.ready.set()

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close(self.cfg.shutdown_timeout_s)

    def cut(self) -> None:
        """The shutdown ran out of time: fail what has not reached the device (answered 503)."""
        if self.batcher is not None:
            self.batcher.cut(f"the server stopped before scoring it (SIGTERM, --shutdown-timeout-s "
                             f"{self.cfg.shutdown_timeout_s:g} s passed)")


def uses_units(cfg: ServeConfig) -> bool:
    """Whether a record of K responses is queued in units of its prompt and several responses
    (--response-units; never --deterministic, where each response is a conversation of its own)."""
    return cfg.response_units and not cfg.deterministic


def authorized(request: Request, api_key: str) -> bool:
    if not api_key:
        return True
    given = request.headers.get("authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), api_key.encode())


async def read_json(request: Request, max_body: int) -> Any:
    """The request's JSON body, at most ``max_body`` bytes (413 past it, read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise RequestError(413, f"the body has {int(declared):,} bytes, at most {max_body:,} (--max-body-mb)",
                           reason="too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise RequestError(413, f"the body is larger than {max_body:,} bytes (--max-body-mb)",
                                   reason="too_large")
            chunks.append(chunk)
    except ClientDisconnect as e:  # nobody to answer: counted, not logged as a failure
        raise RequestError(CLIENT_GONE, "the client disconnected while sending its body",
                           reason="client_disconnected") from e
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the body is not valid UTF-8 ({e})", reason="bad_json") from e
    try:
        return jsontext.loads(text, allow_nan=False)
    except jsontext.NotJsonText as e:
        raise RequestError(400, f"the body is not JSON text: {e}", reason="bad_json") from e
    except (ValueError, RecursionError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}", reason="bad_json") from e


async def _results(service: Service, request: Request, submitted) -> list:
    """The request's results once all are scored; when its client disconnects first, its items
    still waiting are cancelled (they would hold the queue for nobody)."""
    gathered = asyncio.ensure_future(asyncio.gather(*(asyncio.wrap_future(f) for f in submitted)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((gathered, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not gathered.done():
        service.batcher.cancel(submitted)
        gathered.cancel()
        with contextlib.suppress(BaseException):
            await gathered
        service.disconnected += 1
        raise RequestError(CLIENT_GONE, "the client disconnected before its scores were ready",
                           reason="client_disconnected")
    return gathered.result()


async def _answer(service: Service, request: Request, reader: Callable, respond: Responder,
                  headers: dict[str, str]) -> dict[str, Any]:
    """A scoring request's answer: checked, read, queued, scored and put in its protocol's form."""
    cfg = service.cfg
    if not authorized(request, cfg.resolved_api_key()):
        raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", reason="unauthorized")
    if not service.ready.is_set():
        headers["Retry-After"] = str(RETRY_AFTER_S)
        raise RequestError(503, "the model is still loading; see GET /health", reason="not_ready")
    body = await read_json(request, int(cfg.max_body_mb * 1024 * 1024))
    parsed = await run_in_threadpool(reader, body, service.rm, cfg.max_request_items)
    service.metrics.template_mismatches.inc(parsed.options.get("template_mismatches", 0))
    try:
        submitted = service.batcher.submit(parsed.encoded, parsed.sizes, parsed.sequences)
    except QueueFull as e:
        headers["Retry-After"] = str(math.ceil(e.retry_after))
        raise RequestError(503, f"overloaded: {e}; retry after {headers['Retry-After']} s", reason="queue_full") from e
    results = await _results(service, request, submitted)
    if service.monitor is not None:
        observe(service.monitor, parsed.encoded, results)
    payload = respond(service, parsed, results)
    return {**payload, "warnings": parsed.warnings} if parsed.warnings else payload


def observe(monitor: RewardMonitor, items: list, results: list) -> None:
    """A request's conversations, their scores and token counts, to the monitor (a unit of K
    responses: each response with its prompt)."""
    scores, tokens, spreads = [], [], []
    for item, result in zip(items, results):
        fields = result if isinstance(result, list) else [result]
        scores += [f["score"] for f in fields]
        spreads += [f.get(SCORE_STD, math.nan) for f in fields]  # an ensemble's members' spread
        tokens += sequence_tokens(item)
    monitor.observe(scores, tokens, spreads)


def scoring_endpoint(service: Service, name: str, reader: Callable, respond: Responder):
    """The handler of one scoring endpoint: every outcome a status, counted in the metrics."""
    metrics = service.metrics

    async def endpoint(request: Request) -> Response:
        start, headers = time.monotonic(), {}
        try:
            payload, status = await _answer(service, request, reader, respond, headers), 200
        except Closed as e:  # shutting down: before the request was queued, or cut from the queue
            headers["Retry-After"] = str(RETRY_AFTER_S)
            payload, status = {"error": f"shutting down: {e}; retry on another replica or after a restart"}, 503
            metrics.errors.labels(name, "shutting_down").inc()
            service.cut_requests += bool(service.batcher and service.batcher.cut_reason)
        except RequestError as e:
            payload, status = e.body(), e.status
            metrics.errors.labels(name, e.reason).inc()
        except Exception as e:  # noqa: BLE001 - one request fails, the server stays up
            log.exception("%s failed", name)
            payload, status = {"error": f"internal error: {type(e).__name__}: {e}"}, 500
            metrics.errors.labels(name, "internal").inc()
        metrics.requests.labels(name, str(status)).inc()
        metrics.latency.labels(name).observe(time.monotonic() - start)
        return JSONResponse(payload, status, headers=headers)

    return endpoint


def plain_endpoint(service: Service, name: str, make: Callable[[Service], Response]):
    """The handler of an endpoint that scores nothing (health, model, metrics)."""
    metrics = service.metrics

    async def endpoint(request: Request) -> Response:
        if not authorized(request, service.cfg.resolved_api_key()):
            metrics.errors.labels(name, "unauthorized").inc()
            metrics.requests.labels(name, "401").inc()
            return JSONResponse({"error": "missing or wrong API key: send 'Authorization: Bearer <key>'"}, 401)
        response = make(service)
        metrics.requests.labels(name, str(response.status_code)).inc()
        return response

    return endpoint


def health(service: Service) -> Response:
    if service.error:
        return JSONResponse({"status": "failed", "error": service.error}, 500)
    if not service.ready.is_set():
        return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return JSONResponse({"status": "ready", "queue_depth": service.batcher.depth})


def model_info(service: Service) -> Response:
    if not service.ready.is_set():
        return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return JSONResponse({**service.rm.identity(), "max_length": service.rm.max_length,
                         "startup_length": service.startup_length,
                         "batch_shapes": [list(s) for s in service.shapes.shapes],
                         "compiled_shapes": len(service.rm.scorer(service.shapes).compiled),
                         "response_units": service.units, "deterministic": service.cfg.deterministic,
                         "monitor": service.monitor.summary() if service.monitor else None,
                         "endpoints": [path for path, _, _ in SCORING]})


def prometheus(service: Service) -> Response:
    return Response(service.metrics.render(), media_type=service.metrics.content_type)


# path, metrics name, (request reader, responder): the scoring endpoints
SCORING = (
    ("/v1/score", "score", (read_native, respond_native)),
    ("/get_reward", "get_reward", (read_get_reward, respond_get_reward)),
    ("/classify", "classify", (read_classify, respond_classify)),
    ("/pooling", "pooling", (read_pooling, respond_pooling)),
    ("/v1/embeddings", "embeddings", (read_embeddings, respond_embeddings)),
)


def create_app(service: Service) -> Starlette:
    units = uses_units(service.cfg)
    routes = [Route(path, scoring_endpoint(service, name, functools.partial(reader, units=units)
                                           if reader is read_native else reader, respond), methods=["POST"])
              for path, name, (reader, respond) in SCORING]
    routes += [Route("/health", plain_endpoint(service, "health", health), methods=["GET"]),
               Route("/v1/model", plain_endpoint(service, "model", model_info), methods=["GET"]),
               Route("/metrics", plain_endpoint(service, "metrics", prometheus), methods=["GET"])]
    return Starlette(routes=routes)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads: a port in use is one line and exit 1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: restarts reuse the port
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "it is in use (another server there? stop it or choose another --port)" \
            if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise RmflowError(f"cannot listen on {host}:{port}: {why}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(service: Service, app: Starlette):
    """uvicorn's server for ``app``, with rmflow's graceful stop: at --shutdown-timeout-s, what
    has not reached the device is answered 503 (JSON, Retry-After) before uvicorn would cancel
    it, and a stop by SIGTERM / SIGINT is the server's normal end (exit 0, not re-raised)."""
    import uvicorn

    cfg = service.cfg

    class Server(uvicorn.Server):
        stopped_by: list[int] = []

        async def shutdown(self, sockets=None) -> None:
            deadline = asyncio.get_running_loop().call_later(cfg.shutdown_timeout_s, service.cut)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self.stopped_by = list(self._captured_signals)
                self._captured_signals.clear()

    # uvicorn cancels what is still running SHUTDOWN_GRACE_S after rmflow's own deadline (the
    # batch on the device then, at worst): those requests get its plain 500
    return Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                                 timeout_graceful_shutdown=cfg.shutdown_timeout_s + SHUTDOWN_GRACE_S, lifespan="off"))


def _load(service: Service, server, port: int) -> None:
    """Load the model (in a background thread, the port already bound) and say when it is ready;
    a model that cannot load is said once and stops the server."""
    cfg = service.cfg
    try:
        service.load()
    except Exception as e:  # noqa: BLE001 - said once, then the server exits
        service.error = str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
        print(f"rmflow serve: cannot serve {cfg.model}: {service.error}", file=sys.stderr, flush=True)
        server.should_exit = True
        return
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    rm = service.rm
    print(f"rmflow serve: ready on http://{cfg.host}:{port} ({rm.description}, {rm.kind} reward model, up to "
          f"{rm.max_length:,} tokens: {service.max_length_source}; "
          f"{service.shapes.describe(service.startup_length, service.units)})", flush=True)


def serve(cfg: ServeConfig) -> int:
    """Run until SIGTERM / SIGINT (then: stop accepting, finish what is in flight within
    --shutdown-timeout-s, answer what is left 503, exit 0), or until the model fails to load
    (exit 1, the reason on stderr)."""
    sock = listen(cfg.host, cfg.port)
    service = Service(cfg)
    server = _uvicorn_server(service, create_app(service))
    threading.Thread(target=_load, args=(service, server, sock.getsockname()[1]), name="rmflow-load",
                     daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        with contextlib.suppress(Exception):
            service.close()
        sock.close()
    if server.stopped_by:
        cut = service.batcher.cut_items if service.batcher else 0
        how = (f"{service.cut_requests} requests cut at --shutdown-timeout-s {cfg.shutdown_timeout_s:g} s "
               f"({cut} sequences not scored; answered 503 with Retry-After)"
               if service.cut_requests or cut else "requests in flight finished")
        print(f"rmflow serve: stopped by {signal.Signals(server.stopped_by[0]).name} ({how})", flush=True)
    return 1 if service.error else 0
