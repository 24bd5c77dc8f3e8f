"""The OpenAI-compatible HTTP server (standard library ``ThreadingHTTPServer``).

Readiness like vLLM (vllm.md §4.1): the socket is bound at start but ``listen()`` is only called
once the engine is loaded, so connections are refused while loading; there is no "loading" 503.

Endpoints, as vLLM 0.33.0 answers them:

* ``/health``, ``/ping``: 200 empty, 503 once the engine is dead (``health.py``:
  ``engine_client.check_health()`` raises ``EngineDeadError``). During a ``--shutdown-timeout``
  drain it stays 200: only the engine client's shutdown makes it fail.
* ``/v1/models``: one card per served name, ``root`` = the model argument as given
  (``BaseModelPath(name=name, model_path=args.model)`` in
  ``entrypoints/launchers/api_server/app_state.py``; ``show_available_models`` in
  ``entrypoints/openai/models/serving.py``).
* ``/load``: ``{"server_load": n}``, counted only with ``--enable-server-load-tracking``
  (``load_aware_call`` in ``entrypoints/serve/utils/api_utils.py``), else always 0.
* ``/v1/completions`` and ``/v1/chat/completions`` (also ``"stream": true``); without
  ``max_tokens`` a completion gets 16 (``CompletionRequest``), a chat the rest of the context,
  ``max_model_len − prompt tokens`` (``get_max_tokens`` in ``api_utils.py``). A request in flight
  that a shutdown aborts is a finished answer with ``finish_reason: "abort"`` (HTTP 200 when not
  streaming); a request that arrives while the server drains is HTTP 500 ``cannot schedule new
  futures after shutdown`` (``AsyncLLM.shutdown`` in ``vllm/v1/engine/async_llm.py`` shuts the
  renderer's executor down first; the API server's exception handler answers an
  ``InternalServerError``), streaming or not: it fails before any token.
* ``/version``, ``/metrics`` (prometheus_client exposition).

* a known path asked with another method, ``HEAD /health`` included: 405 ``{"detail":"Method Not
  Allowed"}`` with an ``allow`` header (FastAPI's ``APIRoute`` does not add ``HEAD`` to a ``GET``
  route, as Starlette's plain ``Route`` does); an unknown path: 404 ``{"detail":"Not Found"}``.

Engine death (``engine_error_handler`` in ``entrypoints/serve/exception_handling/handlers/
vllm_error.py``): a request that meets it gets HTTP 500 ``InternalServerError`` with
``EngineDeadError.CLIENT_MESSAGE`` (``vllm/v1/engine/exceptions.py``) and the handler calls
``terminate_if_errored``: the server stops at once (about a second after the death, not at the
watchdog's 5 s). A stream that meets it has already sent 200: it gets the error as an SSE event,
``data: {"error": {...}}`` (``create_streaming_error_response``), then ``data: [DONE]``, and
does not stop the server (the watchdog does).

API keys (``--api-key`` or ``$VLLM_API_KEY``) are enforced only on ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` paths: ``401 {"error":"Unauthorized"}``. Keys are never logged.
The request's body is read before the 401 is sent, so a keep-alive connection goes on with the
next request (uvicorn's HTTP/1.1 protocol discards an unread body).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vllm.standin.engine import Engine, EngineDeadError, RequestAborted, ShutdownRejected, count_tokens
from vllm.standin.log import logger
from vllm.standin.lora import Adapter
from vllm.version import __version__

PROTECTED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
#: ``EngineDeadError.CLIENT_MESSAGE`` (``vllm/v1/engine/exceptions.py``, 0.33.0): what a client sees.
ENGINE_DEAD_CLIENT_MESSAGE = "The server had an error while processing your request."
#: vLLM's ``CompletionRequest.max_tokens`` default.
COMPLETION_DEFAULT_MAX_TOKENS = 16


class App:
    """What the request handlers need: engine, names, keys, and the shutdown state."""

    def __init__(
        self,
        engine: Engine,
        served_names: list[str],
        root: str,
        max_model_len: int,
        api_keys: list[str],
        access_log: bool,
        load_tracking: bool = False,
        adapters: list[Adapter] | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = list(adapters or [])  #: static LoRA adapters (``--lora-modules``)
        self.adapter_names = {a.name for a in self.adapters}
        self.served_names = served_names
        self.served_name = served_names[0]
        self.root = root
        self.max_model_len = max_model_len
        self.api_keys = api_keys
        self.access_log = access_log
        self.load_tracking = load_tracking
        self.server_load = 0
        self.created = int(time.time())
        self.client_stopped = False
        self.active = 0
        self.active_lock = threading.Condition()
        #: set when a request met the dead engine: ``terminate_if_errored`` (the server stops now)
        self.terminate = threading.Event()
        #: set at the drain deadline when open streams hang (fault ``drain_open_streams: hang``)
        self.streams_hang = False

    def healthy(self) -> bool:
        return not (self.engine.dead or self.client_stopped)

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no generation request is being handled (``None``: with no limit);
        ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.active_lock:
            while self.active:
                left = 0.1 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                self.active_lock.wait(min(left, 0.1))
        return True


def _error(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    app: App  # set on the subclass made by make_server

    # -- plumbing ----------------------------------------------------------------------
    def address_string(self) -> str:
        addr = self.client_address
        return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else "unix"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.app.access_log:
            path = self.path.split("?", 1)[0]
            logger.info('%s - "%s %s %s" %s', self.address_string(), self.command, path, self.request_version, code)

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() == "content-length":
            self._sent_length = int(value)
        super().send_header(keyword, value)

    def _send(self, code: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(code)
        if body or code != 200 or content_type != "application/json":
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, payload: object) -> None:
        # Starlette's JSONResponse: compact separators
        self._send(code, json.dumps(payload, separators=(",", ":")).encode())

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        data = json.loads(raw or b"{}")
        if not isinstance(data, dict):
            raise ValueError("request body must be a JSON object")
        return data

    def _authorized(self) -> bool:
        if not self.app.api_keys or not self.path.startswith(PROTECTED_PREFIXES):
            return True
        header = self.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        return any(hmac.compare_digest(token.encode(), key.encode()) for key in self.app.api_keys)

    # -- routing -----------------------------------------------------------------------
    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def _discard_body(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        self._status, self._sent_length = 0, 0
        started = time.monotonic()
        try:
            self._dispatch(method, path)
        finally:
            metrics = self.app.engine.metrics
            if metrics is not None and self._status:
                known = path in {"/health", "/ping", "/version", "/load", "/metrics", "/v1/models",
                                 "/v1/completions", "/v1/chat/completions"}  # fmt: skip
                metrics.http(method, path if known else "none", self._status,
                             int(self.headers.get("content-length") or 0), self._sent_length,
                             time.monotonic() - started)  # fmt: skip

    def _dispatch(self, method: str, path: str) -> None:
        if not self._authorized():
            self._discard_body()
            self._json(401, {"error": "Unauthorized"})
            return
        routes: dict[tuple[str, str], Callable[[], None]] = {
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("POST", "/ping"): self._health,
            ("GET", "/version"): lambda: self._json(200, {"version": __version__}),
            ("GET", "/load"): lambda: self._json(200, {"server_load": self.app.server_load}),
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): lambda: self._generate(chat=False),
            ("POST", "/v1/chat/completions"): lambda: self._generate(chat=True),
        }
        handler = routes.get((method, path))
        if handler is None:
            allowed = sorted(m for (m, p) in routes if p == path)
            self._discard_body()
            if not allowed:
                self._json(404, {"detail": "Not Found"})
                return
            body = json.dumps({"detail": "Method Not Allowed"}, separators=(",", ":")).encode()
            self.send_response(405)
            self.send_header("allow", ", ".join(allowed))
            self.send_header("content-length", str(len(body)))
            self.send_header("content-type", "application/json")
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)
            return
        handler()

    def _health(self) -> None:
        self._send(200 if self.app.healthy() else 503)

    def _metrics(self) -> None:
        from vllm.standin.metrics import CONTENT_TYPE

        assert self.app.engine.metrics is not None
        self._send(200, self.app.engine.metrics.render(), CONTENT_TYPE)

    def _models(self) -> None:
        cards = [self._card(name) for name in self.app.served_names]
        cards += [self._lora_card(a) for a in self.app.adapters]
        self._json(200, {"object": "list", "data": cards})

    def _lora_card(self, adapter: Adapter) -> dict[str, Any]:
        """An adapter's card (``OpenAIServingModels.show_available_models``): ``root`` its path as
        given, ``parent`` its base model name or the first served name, no ``max_model_len``."""
        card = self._card(adapter.name)
        card["root"] = adapter.path
        card["parent"] = adapter.base_model_name or self.app.served_names[0]
        card["max_model_len"] = None
        return card

    def _card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.app.created,
            "owned_by": "vllm",
            "root": self.app.root,
            "parent": None,
            "max_model_len": self.app.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.app.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    # -- generation --------------------------------------------------------------------
    def _generate(self, chat: bool) -> None:
        with self.app.active_lock:
            self.app.active += 1
            if self.app.load_tracking:
                self.app.server_load += 1
        try:
            self._generate_inner(chat)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self.app.active_lock:
                self.app.active -= 1
                if self.app.load_tracking:
                    self.app.server_load -= 1
                self.app.active_lock.notify_all()

    def _generate_inner(self, chat: bool) -> None:
        try:
            body = self._body()
        except ValueError as exc:
            self._json(400, _error(f"Invalid request body: {exc}", "BadRequestError", 400))
            return
        model = body.get("model")
        if model is not None and model not in self.app.served_names and model not in self.app.adapter_names:
            self._json(404, _error(f"The model `{model}` does not exist.", "NotFoundError", 404, "model"))
            return
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                self._json(400, _error("messages must be a non-empty list", "BadRequestError", 400, "messages"))
                return
            prompts = ["".join(f"{m.get('role', 'user')}: {m.get('content', '')}\n" for m in messages) + "assistant:"]
        else:
            prompt = body.get("prompt")
            raw = prompt if isinstance(prompt, list) else [prompt]
            if not raw or not all(isinstance(p, str) for p in raw):
                self._json(400, _error("prompt must be a string or a list of strings", "BadRequestError", 400))
                return
            prompts = [str(p) for p in raw]
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
        limits: list[int] = []
        for text in prompts:
            prompt_tokens = count_tokens(text)
            if max_tokens is None:
                model_max = self.app.max_model_len - prompt_tokens
                wanted = max(0, model_max if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, model_max))
            else:
                wanted = int(max_tokens)
            if prompt_tokens + wanted > self.app.max_model_len:
                self._json(
                    400,
                    _error(
                        f"This model's maximum context length is {self.app.max_model_len} tokens. However, you "
                        f"requested {prompt_tokens + wanted} tokens ({prompt_tokens} in the messages, {wanted} in "
                        "the completion). Please reduce the length of the messages or completion.",
                        "BadRequestError",
                        400,
                    ),
                )
                return
            limits.append(wanted)
        try:
            requests = [self.app.engine.new_request(text, n) for text, n in zip(prompts, limits, strict=True)]
        except EngineDeadError:
            self._engine_dead()
            return
        except ShutdownRejected as exc:
            self._json(500, _error(str(exc), "InternalServerError", 500))
            return
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.get("stream"):
            self._stream(chat, rid, kind, requests, model or self.app.served_name)
            return
        choices = []
        for index, req in enumerate(requests):
            tokens: list[str] = []
            finish = "length"
            try:
                for token in self.app.engine.generate(req):
                    tokens.append(token)
            except RequestAborted:
                finish = "abort"
            except EngineDeadError:
                self._engine_dead()
                return
            text = "".join(tokens)
            choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            else:
                choice["text"] = text
            choices.append(choice)
        prompt_total = sum(r.prompt_tokens for r in requests)
        completion_total = sum(r.generated for r in requests)
        self._json(
            200,
            {
                "id": rid,
                "object": kind,
                "created": int(time.time()),
                "model": model or self.app.served_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_total,
                    "total_tokens": prompt_total + completion_total,
                    "completion_tokens": completion_total,
                },
            },
        )

    def _engine_dead(self) -> None:
        """``engine_error_handler``: ``terminate_if_errored``, then the client's 500."""
        self.app.terminate.set()
        self._json(500, _error(ENGINE_DEAD_CLIENT_MESSAGE, "InternalServerError", 500))

    def _stream(self, chat: bool, rid: str, kind: str, requests: list[Any], name: str) -> None:
        """Server-sent events, one chunk per token, then ``data: [DONE]``."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        chunk_kind = "chat.completion.chunk" if chat else kind

        def event(index: int, token: str | None, finish: str | None) -> bytes:
            if chat:
                choice: dict[str, Any] = {"index": index, "delta": {"content": token} if token else {}}
            else:
                choice = {"index": index, "text": token or ""}
            choice["finish_reason"] = finish
            payload = {"id": rid, "object": chunk_kind, "created": int(time.time()),
                       "model": name, "choices": [choice]}  # fmt: skip
            return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

        for index, req in enumerate(requests):
            tokens: Iterator[str] = self.app.engine.generate(req)
            try:
                for token in tokens:
                    self.wfile.write(event(index, token, None))
                    self.wfile.flush()
                finish = "length"
            except RequestAborted:
                finish = "abort"
            except EngineDeadError:
                # completion_stream_generator's ``except Exception``: the error as the next
                # event, then [DONE] (``create_streaming_error_response``)
                if self.app.streams_hang:
                    self._hang()
                error = _error(ENGINE_DEAD_CLIENT_MESSAGE, "InternalServerError", 500)
                self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
                break
            self.wfile.write(event(index, None, finish))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _hang(self) -> None:
        """A stream left open at the drain deadline that gets nothing more, ever (fault
        ``drain_open_streams: hang``): the connection stays open until the process is killed."""
        while True:
            time.sleep(3600)


class _TCPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _TCP6Server(_TCPServer):
    address_family = socket.AF_INET6


class _UnixServer(ThreadingHTTPServer):
    daemon_threads = True
    address_family = socket.AF_UNIX

    def server_bind(self) -> None:  # the socket is bound by make_server
        pass

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)


def make_server(host: str | None, port: int, uds: str | None) -> tuple[ThreadingHTTPServer, str]:
    """Bind (do not listen) the server socket, as vLLM's ``setup_server``; returns the URL too."""
    handler = type("BoundHandler", (Handler,), {})
    server: ThreadingHTTPServer
    if uds:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(uds).st_mode):
                os.unlink(uds)
        server = _UnixServer(uds, handler, bind_and_activate=False)  # type: ignore[arg-type]
        server.socket.bind(uds)
        return server, f"unix:{uds}"
    bind_host = host or ""
    cls: type[_TCPServer] = _TCP6Server if ":" in bind_host else _TCPServer
    server = cls((bind_host, port), handler, bind_and_activate=False)
    server.server_bind()
    shown = bind_host or "0.0.0.0"
    shown = f"[{shown}]" if ":" in shown else shown
    return server, f"http://{shown}:{server.server_address[1]}"


def start_serving(server: ThreadingHTTPServer, app: App) -> threading.Thread:
    """Attach the app, ``listen()`` and serve in a background thread."""
    server.RequestHandlerClass.app = app  # type: ignore[attr-defined]
    server.server_activate()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    return thread
