"""How long `fleet status` takes to observe a fleet, against the loop an operator would write.

    .venv/bin/python benchmarks/monitor_status.py [--instances 20 100 300] [--interval 0]

A child process serves N vLLM-shaped endpoints on loopback ports (``/health``, ``/version`` and a
``/metrics`` written by prometheus_client with vLLM 0.33's names, label sets and bucket layouts:
the request-token histograms on the 1-2-5 series up to 131072, TTFT and e2e on vLLM's buckets,
about 260 samples per scrape). Side by side, per fleet size:

* fleet: ``fleet.monitor.status.collect`` (parallel: /health, /version and two /metrics scrapes
  per instance, parsed with prometheus_client's parser, interval statistics computed);
* a sequential loop: for each instance, GET /metrics twice and parse all of it (what ``for h in
  ...; do curl ...`` in a script amounts to), with no /health or /version;
* parsing alone: one scrape's text through prometheus_client's parser, whole and only the
  families status reads.

``--latency-ms`` delays every answer, as a round trip to a remote site would.

The ``--interval`` between the two scrapes is 0 here so that only the work is measured.

Measured on the 2-core development machine while other test suites ran (load average ~10, so
absolute numbers are pessimistic; the ratios are the point): parsing one scrape 8.4 ms whole,
3.8 ms for the families status reads. On loopback: 20 instances fleet 0.27 s / loop 0.62 s, 100:
1.2 s / 2.4 s, 300: 3.4 s / 5.9 s. With a 20 ms answer delay: 20: 0.21 s / 1.3 s, 100: 0.75 s /
6.2 s, 300: 2.7 s / 17.6 s. The loop grows with instances × round trips; fleet with the parsing
CPU it needs (the client is CPU-bound on prometheus_client's pure-Python parser).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO_ROOT = __file__.rsplit("/benchmarks/", 1)[0]


def vllm_text() -> bytes:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    values = ("meta-llama/Llama-3.1-8B-Instruct", "0")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        Gauge(name, name, labels, registry=reg).labels(*values).set(3)
    for name in ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):  # fmt: skip
        Counter(name, name, labels, registry=reg).labels(*values).inc(1000)
    success = Counter("vllm:request_success", "s", [*labels, "finished_reason"], registry=reg)
    for reason in ("stop", "length", "abort", "error", "repetition"):
        success.labels(*values, reason).inc(10)
    from fleet.monitor.metric_names import token_buckets

    tokens = token_buckets(131072)
    ttft = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
    e2e = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0)  # fmt: skip
    for name, buckets in (("vllm:request_prompt_tokens", tokens), ("vllm:request_generation_tokens", tokens),
                          ("vllm:request_params_max_tokens", tokens), ("vllm:time_to_first_token_seconds", ttft),
                          ("vllm:inter_token_latency_seconds", ttft), ("vllm:e2e_request_latency_seconds", e2e),
                          ("vllm:request_queue_time_seconds", e2e)):  # fmt: skip
        h = Histogram(name, name, labels, buckets=buckets, registry=reg).labels(*values)
        for v in (0.2, 3, 50, 700):
            h.observe(v)
    return generate_latest(reg)


def serve(count: int, latency: float) -> None:
    """Child: ``count`` servers on free loopback ports (each answer ``latency`` s late); prints the
    ports as JSON and runs until stdin closes."""
    body = vllm_text()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(latency)
            payload = {"/metrics": body, "/health": b"", "/version": b'{"version": "0.33.0"}'}.get(self.path)
            self.send_response(200 if payload is not None else 404)
            self.send_header("content-length", str(len(payload or b"")))
            self.end_headers()
            self.wfile.write(payload or b"")

        def log_message(self, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(count)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print(json.dumps([s.server_address[1] for s in servers]), flush=True)
    sys.stdin.read()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, nargs="+", default=[20, 100, 300])
    parser.add_argument("--interval", type=float, default=0.0)
    parser.add_argument(
        "--latency-ms",
        type=float,
        nargs="+",
        default=[0.0, 20.0],
        help="answer delay of the simulated instances (a round trip to a remote site)",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.latency_ms[0] / 1000)
        return
    sys.path.insert(0, REPO_ROOT)
    from fleet.monitor.metric_names import V0_33_0
    from fleet.monitor.scrape import parse_metrics
    from fleet.monitor.status import collect
    from fleet.monitor.targets import Target

    text = vllm_text().decode()
    samples = sum(len(v) for v in parse_metrics(text, 0.0).samples.values())
    for label, families in (("whole", None), ("status families", V0_33_0.status_families)):
        start = time.perf_counter()
        for _ in range(200):
            parse_metrics(text, 0.0, families)
        parse_ms = (time.perf_counter() - start) / 200 * 1000
        print(f"one scrape ({len(text)} bytes, {samples} samples), {label}: parsed in {parse_ms:.2f} ms")
    print(f"{'latency':>8} {'instances':>9} {'fleet status':>13} {'sequential loop':>16}")
    for latency, n in ((lat, n) for lat in args.latency_ms for n in args.instances):
        child = subprocess.Popen([sys.executable, __file__, "--serve", str(n), "--latency-ms", str(latency)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert child.stdout is not None
            ports = json.loads(child.stdout.readline())
            targets = [Target(f"h{i}", "g", "m", 0, "127.0.0.1", p, "0.33.0") for i, p in enumerate(ports)]
            t0 = time.perf_counter()
            rows, _ = collect(targets, interval=args.interval, timeout=10)
            fleet_s = time.perf_counter() - t0
            assert all(r.health.value == "ready" for r in rows), [r.detail for r in rows if not r.ok][:3]
            t0 = time.perf_counter()
            for p in ports:
                for _ in range(2):
                    with urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10) as resp:
                        parse_metrics(resp.read().decode(), time.monotonic())
                time.sleep(0)
            loop_s = time.perf_counter() - t0 + args.interval * len(ports)
            print(f"{latency:>6g}ms {n:>9} {fleet_s:>12.2f}s {loop_s:>15.2f}s")
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=10)


if __name__ == "__main__":
    from fleetlab.netguard import guarded  # tests and benchmarks reach only loopback

    with guarded("benchmarks/monitor_status.py"):
        main()
