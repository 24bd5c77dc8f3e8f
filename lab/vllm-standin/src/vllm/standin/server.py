"""The OpenAI-compatible HTTP server (standard library ``ThreadingHTTPServer``).

Readiness like vLLM (vllm.md §4.1): the socket is bound at start but ``listen()`` is only called
once the engine is loaded, so connections are refused while loading; there is no "loading" 503.

Endpoints (§4.2): ``/health`` and ``/ping`` (200 empty; 503 once the engine is dead or the
server is shutting down), ``/version``, ``/load``, ``/metrics``, ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (also ``"stream": true``). API keys
(``--api-key`` or ``$VLLM_API_KEY``) are enforced only on ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` paths: ``401 {"error":"Unauthorized"}``. Keys are never logged.
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

from vllm.standin import metrics
from vllm.standin.engine import Engine, EngineDeadError, EngineShuttingDown, RequestAborted, count_tokens
from vllm.standin.log import logger
from vllm.version import __version__

PROTECTED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
#: Chat requests without ``max_tokens`` get at most this many tokens (vLLM would allow up to the
#: context length; the lab keeps answers short so tests stay fast).
CHAT_DEFAULT_MAX_TOKENS = 64
#: vLLM's ``CompletionRequest.max_tokens`` default.
COMPLETION_DEFAULT_MAX_TOKENS = 16


class App:
    """What the request handlers need: engine, names, keys, and the shutdown state."""

    def __init__(
        self,
        engine: Engine,
        served_name: str,
        root: str,
        max_model_len: int,
        api_keys: list[str],
        cache_info: dict[str, str],
        access_log: bool,
    ) -> None:
        self.engine = engine
        self.served_name = served_name
        self.root = root
        self.max_model_len = max_model_len
        self.api_keys = api_keys
        self.cache_info = cache_info
        self.access_log = access_log
        self.created = int(time.time())
        self.shutting_down = False
        self.active = 0
        self.active_lock = threading.Condition()

    def healthy(self) -> bool:
        return not (self.engine.dead or self.shutting_down)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is being handled; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        with self.active_lock:
            while self.active:
                left = deadline - time.monotonic()
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

    def _send(self, code: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(code)
        if body or code != 200 or content_type != "application/json":
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, payload: object) -> None:
        self._send(code, json.dumps(payload).encode())

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

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            self._json(401, {"error": "Unauthorized"})
            return
        routes: dict[tuple[str, str], Callable[[], None]] = {
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("POST", "/ping"): self._health,
            ("GET", "/version"): lambda: self._json(200, {"version": __version__}),
            ("GET", "/load"): lambda: self._json(200, {"server_load": self.app.engine.in_flight()}),
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): lambda: self._generate(chat=False),
            ("POST", "/v1/chat/completions"): lambda: self._generate(chat=True),
        }
        handler = routes.get((method, path))
        if handler is None:
            known = {p for (_, p) in routes}
            code = 405 if path in known else 404
            self._json(code, {"detail": "Method Not Allowed" if code == 405 else "Not Found"})
            return
        handler()

    def _health(self) -> None:
        self._send(200 if self.app.healthy() else 503)

    def _metrics(self) -> None:
        text = metrics.render(self.app.engine, self.app.served_name, self.app.cache_info)
        self._send(200, text.encode(), metrics.CONTENT_TYPE)

    def _models(self) -> None:
        card = {
            "id": self.app.served_name,
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
        self._json(200, {"object": "list", "data": [card]})

    # -- generation --------------------------------------------------------------------
    def _generate(self, chat: bool) -> None:
        with self.app.active_lock:
            self.app.active += 1
        try:
            self._generate_inner(chat)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self.app.active_lock:
                self.app.active -= 1
                self.app.active_lock.notify_all()

    def _generate_inner(self, chat: bool) -> None:
        try:
            body = self._body()
        except ValueError as exc:
            self._json(400, _error(f"Invalid request body: {exc}", "BadRequestError", 400))
            return
        model = body.get("model")
        if model not in (None, self.app.served_name):
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
                wanted = COMPLETION_DEFAULT_MAX_TOKENS if not chat else CHAT_DEFAULT_MAX_TOKENS
                wanted = max(0, min(wanted, self.app.max_model_len - prompt_tokens))
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
        except EngineShuttingDown as exc:
            self._json(503, _error(str(exc), "ServiceUnavailableError", 503))
            return
        except EngineDeadError as exc:
            self._json(500, _error(str(exc), "EngineDeadError", 500))
            return
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.get("stream"):
            self._stream(chat, rid, kind, requests)
            return
        choices = []
        for index, req in enumerate(requests):
            try:
                text = "".join(self.app.engine.generate(req))
            except RequestAborted:
                self._json(503, _error("The request was aborted: the server is shutting down.", "AbortedError", 503))
                return
            except EngineDeadError as exc:
                self._json(500, _error(str(exc), "EngineDeadError", 500))
                return
            choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": "length", "stop_reason": None}
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
                "model": self.app.served_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_total,
                    "total_tokens": prompt_total + completion_total,
                    "completion_tokens": completion_total,
                },
            },
        )

    def _stream(self, chat: bool, rid: str, kind: str, requests: list[Any]) -> None:
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
                       "model": self.app.served_name, "choices": [choice]}  # fmt: skip
            return f"data: {json.dumps(payload)}\n\n".encode()

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
                finish = "error"
            self.wfile.write(event(index, None, finish))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


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
