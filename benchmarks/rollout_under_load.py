"""Rollouts that clients never notice, measured with a client nobody here wrote (``openai``).

Drives a deployed lab fleet through its load balancer (``fleet lab up --lb``, then ``fleet
deploy``) with the ``openai`` Python client, no retries of its own: ``--workers`` closed-loop
clients, mixed short (16 tokens) and long (400 tokens) completions, half of them streaming.
For each of ``fleet restart`` and ``fleet rollout --model M`` (and back), it runs the command
once on the idle fleet and once under load, and reports:

* failed requests (an HTTP error, a broken connection, ``finish_reason: "abort"``, a stream that
  ends without its finishing chunk): target 0;
* p50/p99 latency of the requests before the rollout vs during it;
* the rollout's duration under load vs idle: target <= 1.25x.

    python benchmarks/rollout_under_load.py --lab NAME [--workers 8] [--model M] [--served NAME] [--soak S]
                                            [--no-lb-too]

It first writes ``bench-inventory.py`` beside the lab's inventory: the same hosts serving under a
stable name (``--served``, default ``chat``: clients keep asking for it while the model behind it
changes, as an operator sets ``served_model_name``), stages ``--model``'s config on every host and
deploys it (which also reconfigures the lab's balancer). ``fleet rollout --model`` is measured
going to ``--model``; after each run the fleet is rolled back to the inventory's model, unmeasured.

``--no-lb-too`` runs the restart under load once more with ``--no-lb`` (what clients see without a
balancer in the loop). Everything it sends goes to the lab's balancer on 127.0.<octet>.1.

Measured on 2026-11-26 on the shared 2-core machine, other engineers' labs and tests running (load
average 3 to 11 during the runs): ``fleet lab up --name ul --lb --hosts 2`` (2 x 8 H100 SXM: 16
instances of Llama-3.1-8B behind the lab's HAProxy), ``fleet deploy``, then ``--workers 8``; default
batches ``[1, "25%"]`` (5 batches), ``--probe-interval 0.5``; the model rollout goes to Mistral-7B
under the served name ``chat``. Durations are the command's (for ``rollout --model`` that includes
``fleet deploy``'s operations); "engine" is the journaled rollout alone. Seconds throughout.

| code | soak | rollout | requests | failed | p50/p99 before | p50/p99 during | idle | under load | ratio (engine) |
|---|---|---|---|---|---|---|---|---|---|
| final | 5 | fleet restart | 809 | 0 | 0.104/2.249 | 0.103/2.522 | 68.4 | 67.3 | 0.98 (1.04) |
| final | 5 | fleet rollout --model | 1034 | 0 | 0.102/2.222 | 0.114/2.457 | 70.7 | 90.8 | 1.28 (1.23) |
| final | 1 | fleet restart | 665 | 0 | 0.106/2.254 | 0.106/2.435 | 39.0 | 53.7 | 1.38 (1.31) |
| final | 1 | fleet rollout --model | 782 | 0 | 0.095/2.177 | 0.106/2.435 | 61.1 | 64.1 | 1.05 (1.07) |
| before the same-tick stop | 1 | fleet restart | 569 | 0 | 0.090/2.078 | 0.093/2.208 | 33.5 | 40.7 | 1.21 |
| before the same-tick stop | 1 | fleet rollout --model | 641 | 0 | 0.091/2.115 | 0.096/2.188 | 42.3 | 47.5 | 1.12 |
| before the same-tick stop | 1 | fleet restart | 593 | 0 | 0.094/2.167 | 0.094/2.269 | 36.0 | 42.8 | 1.19 |
| before the same-tick stop | 1 | fleet rollout --model | 689 | 0 | 0.094/2.167 | 0.095/2.267 | 42.4 | 51.9 | 1.22 |

No request failed in any run (and p50/p99 during the rollouts is what it was before). The duration
target (under load <= 1.25x idle) holds at issue 18's soak (5 s) for the restart and is missed by a
little for the model rollout (1.28: its deploy part, pyinfra's operations, took 15 s under load
against 9 s idle, CPU shared with the load generator); at a 1 s soak it is missed by the restart
(1.31 engine). Where the extra time goes (the journal's steps): from ``lb:drain`` to ``stop`` an
instance takes 0.13-0.24 s idle and 1.0-1.2 s on average under load, up to 3-3.5 s: the requests in
flight when it left traffic finishing (a 400-token completion is 2 s on the stand-in, plus its
queue), and a batch waits for its slowest instance, five batches over; start to ``ready`` is the same
idle and under load. That wait is the price of aborting no request: nothing in fleet waits longer
than the requests themselves. The earlier rows are faster idle by 0.5 s per instance, which the
engine lost by reading vLLM's in-flight count a probe interval after the balancer's (fixed: both from
one observation), so their ratio was lower while every duration was longer. Issue 18 measured the
same restart without the balancer in the loop: 45 % failed, 8x as long.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

FLEET = Path(sys.executable).parent / "fleet"


class Load:
    def __init__(self, url: str, model: str, workers: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done: list[tuple[float, float]] = []  # (finished at, seconds)
        self.failed: list[tuple[float, str]] = []
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(workers)]

    def _one(self, i: int, n: int) -> str | None:
        tokens = 400 if (i + n) % 3 == 0 else 16
        prompt = f"benchmark {i} {n}"
        if (i + n) % 2:
            finish = None
            for chunk in self.client.completions.create(model=self.model, prompt=prompt, max_tokens=tokens,
                                                        stream=True):  # fmt: skip
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if finish is None:
                return "truncated stream"
        else:
            finish = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=tokens).choices[0]
            finish = finish.finish_reason
        return None if finish in ("length", "stop") else f"finish_reason {finish}"

    def _worker(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            t0 = time.monotonic()
            try:
                why = self._one(i, n)
            except Exception as exc:  # any error of the client is a failed request
                why = f"{type(exc).__name__}: {str(exc)[:120]}"
            with self.lock:
                if why is None:
                    self.done.append((time.monotonic(), time.monotonic() - t0))
                else:
                    self.failed.append((time.monotonic(), why))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)

    def latency(self, start: float, end: float) -> tuple[float, float, int]:
        xs = sorted(s for at, s in self.done if start <= at <= end)
        if not xs:
            return float("nan"), float("nan"), 0
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        return statistics.median(xs), p99, len(xs)


def fleet(*args: str) -> tuple[int, dict[str, Any], float]:
    t0 = time.monotonic()
    proc = subprocess.run([str(FLEET), *args, "--json"], capture_output=True, text=True, timeout=3600, check=False)
    took = time.monotonic() - t0
    try:
        return proc.returncode, json.loads(proc.stdout), took
    except ValueError:
        return proc.returncode, {"error": (proc.stdout + proc.stderr)[-2000:]}, took


def must(name: str, *argv: str) -> float:
    rc, out, took = fleet(*argv)
    if rc:
        raise SystemExit(f"{name} failed ({rc}): {json.dumps(out)[-2000:]}")
    return took


def measure(name: str, argv: list[str], url: str, model: str, workers: int, back: list[str] | None) -> dict[str, Any]:
    """``argv`` on the idle fleet, then under load; ``back`` (a rollout to what it was) after each."""
    idle = must(f"{name} on the idle fleet", *argv)
    if back:
        must(f"{name}: back, idle", *back)
    load = Load(url, model, workers)
    load.start()
    time.sleep(10)
    t0 = time.monotonic()
    rc, out, busy = fleet(*argv)
    t1 = time.monotonic()
    time.sleep(3)
    load.finish()
    if back:
        must(f"{name}: back", *back)
    p50b, p99b, nb = load.latency(t0 - 10, t0)
    p50d, p99d, nd = load.latency(t0, t1)
    row = {
        "rollout": name, "exit": rc, "status": out.get("status") or ("done" if out.get("ok") else out.get("error")),
        "idle_s": round(idle, 1),
        "under_load_s": round(busy, 1),
        "ratio": round(busy / idle, 2), "requests": len(load.done) + len(load.failed), "failed": len(load.failed),
        "failures": sorted({w for _t, w in load.failed})[:5], "p50_before_s": round(p50b, 3),
        "p99_before_s": round(p99b, 3), "p50_during_s": round(p50d, 3), "p99_during_s": round(p99d, 3),
        "requests_before": nb, "requests_during": nd,
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def prepare(lab_inventory: str, served: str, other: str) -> str:
    """An inventory beside the lab's with a stable served name (clients keep asking for it while
    the model behind it changes, as an operator sets ``served_model_name``), the other model's
    config staged on every host; deployed (which also reconfigures the lab's balancer)."""
    import pprint
    import runpy

    from fleet.facts.runner import SshTarget, run_command
    from fleetlab.models import staging_command

    groups = {k: v for k, v in runpy.run_path(lab_inventory).items() if isinstance(v, list) and not k.startswith("_")}
    text = []
    for group, hosts in groups.items():
        hosts = [(n, {**d, "served_model_name": served, "rollout": {"soak_s": 1, "probe_interval_s": 0.5}})
                 for n, d in hosts]  # fmt: skip
        for n, d in hosts:
            rc, out, err = run_command(SshTarget.from_data(n, d), staging_command(other))
            if rc:
                raise SystemExit(f"staging {other} on {n}: {err or out}")
        text.append(f"{group} = {pprint.pformat(hosts, sort_dicts=False)}")
    path = Path(lab_inventory).with_name("bench-inventory.py")
    path.write_text("\n".join(text) + "\n")
    must("fleet deploy of the benchmark's inventory", "deploy", str(path))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab", default="lab")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--model", default="mistralai/Mistral-7B-Instruct-v0.3",
                    help="the model `fleet rollout --model` switches to (and back from)")  # fmt: skip
    ap.add_argument("--served", default="chat", help="the served model name clients ask for")
    ap.add_argument("--soak", type=float, default=1.0,
                    help="seconds every gate must stay green (issue 18 measured with 5)")  # fmt: skip
    ap.add_argument("--no-lb-too", action="store_true")
    a = ap.parse_args()
    status = json.loads(subprocess.run([str(FLEET), "lab", "status", "--name", a.lab, "--json"], capture_output=True,
                                       text=True, check=False).stdout)  # fmt: skip
    url = status.get("lb_url")
    if not url:
        raise SystemExit(f"lab {a.lab} has no load balancer: fleet lab up --name {a.lab} --lb, then fleet deploy")
    inventory = prepare(str(status.get("inventory") or f"/var/lib/fleet-lab/{a.lab}/inventory.py"), a.served, a.model)
    fast = ["--soak", f"{a.soak:g}", "--probe-interval", "0.5"]
    rows = [measure("fleet restart", ["restart", inventory, *fast], url, a.served, a.workers, None)]
    rows.append(measure("fleet rollout --model", ["rollout", inventory, "--model", a.model, *fast], url, a.served,
                        a.workers, ["rollout", inventory, *fast]))  # fmt: skip
    if a.no_lb_too:
        rows.append(measure("fleet restart --no-lb", ["restart", inventory, "--no-lb", *fast], url, a.served,
                            a.workers, None))  # fmt: skip
    head = (
        "| rollout | requests | failed | p50/p99 before (s) | p50/p99 during (s) | idle (s) | under load (s) | ratio |"
    )
    print("\n" + head)
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        before = f"{r['p50_before_s']}/{r['p99_before_s']}"
        during = f"{r['p50_during_s']}/{r['p99_during_s']}"
        print(f"| {r['rollout']} | {r['requests']} | {r['failed']} | {before} | {during} | {r['idle_s']} | "
              f"{r['under_load_s']} | {r['ratio']} |")  # fmt: skip


if __name__ == "__main__":
    main()
