"""The observer's HTTP side: gate probes of one vLLM instance from the control machine.

Thin I/O over the standard library's HTTP client, every request bounded by a timeout:
``GET /health``, ``GET /v1/models``, one ``POST /v1/completions`` with a tiny ``max_tokens``,
and ``GET /metrics`` parsed with prometheus_client's own text parser through
``fleet.monitor.scrape`` (vLLM writes its metrics with prometheus_client,
``vllm/v1/metrics/loggers.py``; names from ``fleet.monitor.metric_names``). Answers become ``gates`` data; verdicts are
not made here.

The API key is read from the instance's secret reference (``env:NAME`` or ``file:/path`` on the
control machine) and sent only as an ``Authorization: Bearer`` header; it is never put in a
URL, an error message or a ``repr``.

"Drained" is not read from ``/health`` (vLLM keeps it at 200 while draining):
``in_flight`` is ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` from ``/metrics``;
the caller treats a gone process as drained too.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fleet.monitor.metric_names import V0_33_0
from fleet.monitor.scrape import ScrapeError, parse_metrics
from fleet.rollout.gates import (
    CompletionAnswer,
    HttpAnswer,
    MetricsAnswer,
    ModelsAnswer,
    Probe,
    Sample,
    UnitState,
)
from fleet.rollout.policy import RolloutPolicy

RUNNING = V0_33_0.running
WAITING = V0_33_0.waiting


def parse_samples(text: str, families: Collection[str] | None = None) -> tuple[Sample, ...]:
    """The samples of a Prometheus text exposition (only ``families`` when given), under their
    exposed names (``_total`` etc.); parsed by ``fleet.monitor.scrape`` (prometheus_client)."""
    scrape = parse_metrics(text, 0.0, families)
    return tuple((name, labels, value) for name, series in scrape.samples.items() for labels, value in series)


@dataclass(frozen=True)
class _Reply:
    status: int | None
    body: bytes
    error: str
    elapsed_s: float


class InstanceProber:
    """HTTP probes of one instance (``base_url`` like ``http://10.0.0.5:8000``)."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.__key = api_key

    def __repr__(self) -> str:
        return (
            f"InstanceProber({self.base_url!r}, timeout_s={self.timeout_s}, api_key={'<set>' if self.__key else None})"
        )

    def _request(self, path: str, body: dict[str, Any] | None = None) -> _Reply:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method="POST" if data is not None else "GET")
        req.add_header("content-type", "application/json")
        if self.__key:
            req.add_header("authorization", f"Bearer {self.__key}")
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = resp.read()
                return _Reply(int(resp.status), payload, "", time.monotonic() - t0)
        except urllib.error.HTTPError as err:
            with err:
                return _Reply(int(err.code), err.read(), "", time.monotonic() - t0)
        except TimeoutError:
            return _Reply(None, b"", f"timed out after {self.timeout_s:g}s", time.monotonic() - t0)
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, TimeoutError | socket.timeout):
                return _Reply(None, b"", f"timed out after {self.timeout_s:g}s", time.monotonic() - t0)
            return _Reply(None, b"", _os_error(reason), time.monotonic() - t0)
        except OSError as err:
            return _Reply(None, b"", _os_error(err), time.monotonic() - t0)

    def health(self) -> HttpAnswer:
        r = self._request("/health")
        return HttpAnswer(r.status, r.error, r.elapsed_s)

    def models(self) -> ModelsAnswer:
        r = self._request("/v1/models")
        ids: tuple[str, ...] = ()
        adapters: tuple[str, ...] = ()
        if r.status == 200:
            try:
                data = json.loads(r.body)
                ids = tuple(str(m["id"]) for m in data.get("data", []))
                adapters = tuple(str(m["id"]) for m in data.get("data", []) if m.get("parent") is not None)
            except (ValueError, KeyError, TypeError, AttributeError):
                return ModelsAnswer(r.status, "not the OpenAI model list", r.elapsed_s)
        return ModelsAnswer(r.status, r.error, r.elapsed_s, ids=ids, adapters=adapters)

    def completion(self, model: str, prompt: str, max_tokens: int) -> CompletionAnswer:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = self._request("/v1/completions", body)
        if r.status != 200:
            return CompletionAnswer(r.status, r.error or _error_message(r.body), r.elapsed_s)
        try:
            data = json.loads(r.body)
            choice = data["choices"][0]
            tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
            return CompletionAnswer(
                r.status,
                "",
                r.elapsed_s,
                text=str(choice.get("text") or ""),
                finish_reason=choice.get("finish_reason"),
                completion_tokens=tokens,
            )
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return CompletionAnswer(r.status, "not an OpenAI completion", r.elapsed_s)

    def metrics(self, families: Collection[str] | None = None) -> MetricsAnswer:
        """``/metrics``, parsed (only ``families`` when given: parsing is most of a scrape's cost)."""
        r = self._request("/metrics")
        if r.status != 200:
            return MetricsAnswer(r.status, r.error, r.elapsed_s)
        try:
            samples = parse_samples(r.body.decode("utf-8", "replace"), families)
        except ScrapeError as exc:
            return MetricsAnswer(None, f"/metrics: {exc}", r.elapsed_s)
        return MetricsAnswer(r.status, "", r.elapsed_s, samples=samples)

    def in_flight(self) -> float | None:
        """Requests running + waiting, from ``/metrics``; None when it gives no answer."""
        m = self.metrics((RUNNING, WAITING))
        running, waiting = m.value(RUNNING), m.value(WAITING)
        if running is None or waiting is None:
            return None
        return running + waiting

    def probe(
        self, model: str, policy: RolloutPolicy, unit: UnitState | None = None, now: float | None = None
    ) -> Probe:
        """The gates' probes in order, stopping at the first that cannot pass (no completion is
        asked of a server whose ``/health`` is refused)."""
        at = time.time() if now is None else now
        health = self.health()
        if health.status != 200:
            return Probe(at, unit=unit, health=health)
        models = self.models()
        if models.status != 200 or model not in models.ids:
            return Probe(at, unit=unit, health=health, models=models)
        completion = self.completion(model, policy.completion.prompt, policy.completion.max_tokens)
        metrics = self.metrics({t.name for t in policy.metrics}) if policy.metrics else None
        return Probe(at, unit=unit, health=health, models=models, completion=completion, metrics=metrics)


def _os_error(err: object) -> str:
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, ConnectionResetError):
        return "connection reset"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return str(err)


def _error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body (vLLM's ``ErrorResponse``), or ""."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return str(message)[:300] if isinstance(message, str) else ""
