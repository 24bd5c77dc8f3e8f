"""fleet's GPU watcher: the XID and ECC events of this host's GPUs, recorded, exported, quarantined.

Runs on every GPU host as its own systemd unit (``fleet-gpu-watch.service``, rendered by
``fleet.render.units``), with the host's own ``python3`` (3.6 or newer) and the pynvml fleet was
tested with, carried in the same file (``fleet.gpuwatch.program``: nothing is installed with pip).

**Sources.** For every GPU it registers for ``nvmlEventTypeXidCriticalError``,
``nvmlEventTypeDoubleBitEccError`` and ``nvmlEventTypeSingleBitEccError`` (NVML "Event Handling
Methods": ``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``, ``nvmlEventSetWait_v2``; ECC types
only where ``nvmlDeviceGetSupportedEventTypes`` offers them, i.e. ECC is on) and waits on one event
set. A GPU whose driver offers no XID events (``nvmlDeviceRegisterEvents`` answers NOT_SUPPORTED,
as NVML allows) is watched through the kernel log instead: ``journalctl --dmesg --follow
--output=json`` (journald keeps the kernel's ring buffer), matching ``NVRM: Xid (PCI:...)`` lines
to the GPU's bus id (``fleet.gpuwatch.catalog.parse_kernel_xid``); the journal cursor is kept, so a
restarted watcher reads what it missed. NVML delivers only events that occur after registration
(nvmlDeviceRegisterEvents: "All events that occurred before this call are not recorded").

**Record.** ``<state dir>/record.json`` (root-owned, written atomically: a temporary file in the
same directory, fsync, rename): per GPU (by UUID: NVML's index can change between boots) its
index, bus id and name, the last :data:`KEEP_EVENTS` events (time, kind, XID, fleet's action and
NVIDIA's meaning, source; a flood of corrected errors never pushes out a critical one), counts by
kind and XID, and the record's id, host (``/etc/machine-id``) and the last sequence number. A record
that is not valid JSON of this schema, or that another machine wrote (a cloned disk), is moved aside
(``record.json.corrupt-<time>`` / ``.from-<machine id>``) and a new one begun, saying so on stderr
(the journal). ``<state dir>/clears.json`` is written by ``fleet gpu clear`` (who, when, why, and the
sequence number the GPU was cleared through); the watcher only reads it.

**Quarantine** is :func:`fleet.gpuwatch.catalog.quarantine_since`: a critical event after the GPU's
last clear. The watcher exports it; fleet's planner and gates act on it.

**Export.** ``<textfile dir>/fleet_gpu_watch.prom`` for node_exporter's textfile collector
(Prometheus text format; written atomically, as node_exporter's documentation asks):
``fleet_gpu_events_total``, ``fleet_gpu_quarantined``, ``fleet_gpu_last_event_timestamp_seconds``,
``fleet_gpu_watch_source``, ``fleet_gpu_watch_up`` and ``fleet_gpu_watch_last_update_timestamp_seconds``
(rewritten at least every :data:`HEARTBEAT_S` seconds, so a stale file means a dead watcher).

**A driver that goes away** (reloaded, upgraded, a GPU lost): any NVML error other than a timeout
ends the session (event set freed, ``nvmlShutdown``); the watcher re-initialises with exponential
backoff (1 s doubling to :data:`BACKOFF_MAX_S`, with jitter), exporting ``fleet_gpu_watch_up 0``
meanwhile. It never touches a GPU's state and holds no lock the engine needs; its unit runs at the
lowest CPU and I/O priority with CPU and memory caps and no network.

Written for Python 3.6: standard library, ``typing`` annotations, %-formatting.
"""

import argparse
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

try:  # carried with the watcher (fleet.gpuwatch.program)
    import fleet_gpu_catalog as catalog
except ImportError:  # run from a checkout of fleet
    from fleet.gpuwatch import catalog

SCHEMA = 1
RECORD = "record.json"
CLEARS = "clears.json"
TEXTFILE = "fleet_gpu_watch.prom"
DEFAULT_STATE_DIR = "/var/lib/fleet/gpu-watch"
#: node_exporter's textfile directory as Debian's and Ubuntu's prometheus-node-exporter set it.
DEFAULT_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
KEEP_EVENTS = 64
KEEP_PROBLEMS = 10
HEARTBEAT_S = 60.0
BACKOFF_MAX_S = 60.0
#: nvml.h nvmlEventType*
EVENT_SBE = 0x1
EVENT_DBE = 0x2
EVENT_XID = 0x8
KIND_OF = {EVENT_XID: "xid", EVENT_SBE: "sbe", EVENT_DBE: "dbe"}
NVML = "nvml"
KERNEL_LOG = "kernel-log"


def log(message: str) -> None:
    sys.stderr.write("fleet-gpu-watch: %s\n" % message)
    sys.stderr.flush()


def read_machine_id(path: str = "/etc/machine-id") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``path`` so a reader sees the old file or the new one, never half of it."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, ".%s.tmp-%d" % (name, os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.rename(tmp, path)


# ---- the record ------------------------------------------------------------------------------------


def new_record(machine_id: str, hostname: str, now: float) -> Dict[str, Any]:
    return {
        "schema": SCHEMA,
        "record_id": "%016x" % random.SystemRandom().getrandbits(64),
        "machine_id": machine_id,
        "hostname": hostname,
        "created_at": now,
        "updated_at": now,
        "seq": 0,
        "journal_cursor": None,
        "gpus": {},
        "problems": [],
    }


def record_problem(raw: Any) -> Optional[str]:
    """Why ``raw`` is not a record of this schema (None: it is)."""
    if not isinstance(raw, dict):
        return "not a JSON object"
    if raw.get("schema") != SCHEMA:
        return "schema %r, not %d" % (raw.get("schema"), SCHEMA)
    for key, kind in (("record_id", str), ("machine_id", str), ("seq", int), ("gpus", dict)):
        if not isinstance(raw.get(key), kind) or isinstance(raw.get(key), bool):
            return "%s=%r is not a %s" % (key, raw.get(key), kind.__name__)
    for uuid, gpu in raw["gpus"].items():
        if not isinstance(gpu, dict) or not isinstance(gpu.get("events"), list):
            return "gpus[%s] has no event list" % uuid
        for event in gpu["events"]:
            if not isinstance(event, dict) or not isinstance(event.get("seq"), int) or event["seq"] > raw["seq"]:
                return "gpus[%s] has an event without a valid seq" % uuid
    return None


class Record:
    """``record.json``: loaded (or begun), changed in memory, saved atomically."""

    def __init__(self, state_dir: str, machine_id: str, hostname: str, now: float) -> None:
        self.path = os.path.join(state_dir, RECORD)
        self.data = self._load(machine_id, hostname, now)

    def _load(self, machine_id: str, hostname: str, now: float) -> Dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            return new_record(machine_id, hostname, now)
        try:
            raw = json.loads(text.decode("utf-8"))
            why = record_problem(raw)
        except ValueError as exc:
            raw, why = None, "not JSON (%s)" % exc
        if why is not None:
            aside = "%s.corrupt-%d" % (self.path, int(now))
            log("%s is not a watcher record (%s): moved to %s, a new record begins" % (self.path, why, aside))
        elif machine_id and raw["machine_id"] != machine_id:
            aside = "%s.from-%s" % (self.path, raw["machine_id"][:32] or "unknown")
            log(
                "%s was written on another machine (machine-id %s, this one is %s): moved to %s, a new record begins"
                % (self.path, raw["machine_id"], machine_id, aside)
            )
        else:
            return raw  # type: ignore[no-any-return]
        os.rename(self.path, aside)
        return new_record(machine_id, hostname, now)

    def gpu(self, uuid: str, index: Optional[int], bus_id: str, name: str, source: str) -> Dict[str, Any]:
        entry = self.data["gpus"].setdefault(uuid, {"events": [], "counts": {}, "dropped": 0})
        entry.update({"index": index, "bus_id": bus_id, "name": name, "source": source})
        return entry  # type: ignore[no-any-return]

    def add(self, uuid: str, kind: str, xid: Optional[int], at: float, source: str, detail: str = "") -> Dict[str, Any]:
        action, text = catalog.meaning(kind, xid)
        self.data["seq"] += 1
        event = {
            "seq": self.data["seq"],
            "t": at,
            "kind": kind,
            "xid": xid,
            "action": action,
            "meaning": text,
            "source": source,
        }
        if detail:
            event["detail"] = detail[:300]
        entry = self.data["gpus"][uuid]
        key = "xid:%d" % xid if xid is not None else kind
        entry["counts"][key] = entry["counts"].get(key, 0) + 1
        entry["events"], dropped = catalog.trim(entry["events"] + [event], KEEP_EVENTS)
        entry["dropped"] = entry.get("dropped", 0) + dropped
        entry["last_event_at"] = at
        return event

    def problem(self, now: float, text: str) -> None:
        problems = self.data.setdefault("problems", [])
        problems.append({"t": now, "what": text[:300]})
        del problems[:-KEEP_PROBLEMS]

    def save(self, now: float) -> None:
        self.data["updated_at"] = now
        atomic_write(self.path, (json.dumps(self.data, sort_keys=True, indent=1) + "\n").encode("utf-8"))


def cleared_through(clears: Any, record_id: str, uuid: str) -> int:
    """The newest sequence number ``fleet gpu clear`` cleared ``uuid`` through, in this record."""
    best = 0
    gpus = clears.get("gpus") if isinstance(clears, dict) else None
    entries = gpus.get(uuid, []) if isinstance(gpus, dict) else []
    for c in entries if isinstance(entries, list) else []:
        if isinstance(c, dict) and c.get("record_id") == record_id and isinstance(c.get("through_seq"), int):
            best = max(best, c["through_seq"])
    return best


def read_clears(state_dir: str) -> Any:
    try:
        with open(os.path.join(state_dir, CLEARS)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# ---- the textfile ----------------------------------------------------------------------------------


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: Any) -> str:
    return "{" + ",".join('%s="%s"' % (k, _label(v)) for k, v in labels.items()) + "}"


def textfile(record: Dict[str, Any], clears: Any, up: bool, now: float) -> str:
    """Prometheus text format for node_exporter's textfile collector (pure)."""
    out = []

    def family(name: str, kind: str, help_: str) -> None:
        out.append("# HELP %s %s" % (name, help_))
        out.append("# TYPE %s %s" % (name, kind))

    gpus = sorted(record["gpus"].items(), key=lambda kv: (kv[1].get("index") is None, kv[1].get("index") or 0, kv[0]))
    family("fleet_gpu_events_total", "counter", "GPU events the watcher recorded, by kind and XID.")
    for uuid, g in gpus:
        for key in sorted(g.get("counts", {})):
            kind, _, xid = key.partition(":")
            action = catalog.meaning(kind, int(xid) if xid else None)[0]
            labels = _labels(gpu=g.get("index", ""), uuid=uuid, kind=kind, xid=xid, action=action)
            out.append("fleet_gpu_events_total%s %d" % (labels, g["counts"][key]))
    family("fleet_gpu_quarantined", "gauge", "1 while the GPU has a critical event since its last clear.")
    for uuid, g in gpus:
        since = catalog.quarantine_since(g["events"], cleared_through(clears, record["record_id"], uuid))
        reason = {"kind": since["kind"], "xid": since.get("xid") or "", "action": since["action"]} if since else {}
        labels = _labels(gpu=g.get("index", ""), uuid=uuid, **reason)
        out.append("fleet_gpu_quarantined%s %d" % (labels, 1 if since else 0))
    family("fleet_gpu_last_event_timestamp_seconds", "gauge", "When the GPU's last recorded event happened.")
    for uuid, g in gpus:
        if g.get("last_event_at"):
            out.append("fleet_gpu_last_event_timestamp_seconds%s %.3f" % (_labels(gpu=g.get("index", ""), uuid=uuid),
                                                                           g["last_event_at"]))  # fmt: skip
    family("fleet_gpu_watch_source", "gauge", "Where the watcher reads each GPU's events from (nvml, kernel-log).")
    for uuid, g in gpus:
        if g.get("source"):
            out.append("fleet_gpu_watch_source%s 1" % _labels(gpu=g.get("index", ""), uuid=uuid, source=g["source"]))
    family("fleet_gpu_watch_up", "gauge", "Whether the watcher has an NVML session (1) or is beginning one anew (0).")
    out.append("fleet_gpu_watch_up %d" % (1 if up else 0))
    family("fleet_gpu_watch_last_update_timestamp_seconds", "gauge", "When the watcher last wrote this file.")
    out.append("fleet_gpu_watch_last_update_timestamp_seconds %.3f" % now)
    return "\n".join(out) + "\n"


# ---- NVML ------------------------------------------------------------------------------------------


class SessionLost(Exception):
    """NVML answered an error other than a timeout: the session must be begun anew."""


def _address(handle: Any) -> Optional[int]:
    return ctypes.cast(handle, ctypes.c_void_p).value


class NvmlSession:
    """One ``nvmlInit`` .. ``nvmlShutdown``: the GPUs, one event set, each GPU's source."""

    def __init__(self, N: Any) -> None:
        self.N = N
        self.set: Any = None
        self.gpus: List[Dict[str, Any]] = []
        self.problems: List[str] = []
        self.by_handle: Dict[Optional[int], Dict[str, Any]] = {}
        N.nvmlInit()
        try:
            self.set = N.nvmlEventSetCreate()
            for i in range(N.nvmlDeviceGetCount()):
                try:
                    handle = N.nvmlDeviceGetHandleByIndex(i)
                    gpu = {
                        "index": i,
                        "uuid": N.nvmlDeviceGetUUID(handle),
                        "bus_id": str(N.nvmlDeviceGetPciInfo(handle).busId).upper(),
                        "name": N.nvmlDeviceGetName(handle),
                    }
                except N.NVMLError as exc:
                    self.problems.append("GPU %d does not answer NVML (%s); not watched" % (i, type(exc).__name__))
                    continue
                gpu["source"] = self._register(handle, gpu)
                self.gpus.append(gpu)
                self.by_handle[_address(handle)] = gpu
        except BaseException:
            self.close()
            raise

    def _register(self, handle: Any, gpu: Dict[str, Any]) -> str:
        N = self.N
        try:
            supported = N.nvmlDeviceGetSupportedEventTypes(handle)
        except N.NVMLError_NotSupported:
            supported = 0
        if not supported & EVENT_XID:
            return KERNEL_LOG
        try:
            N.nvmlDeviceRegisterEvents(handle, EVENT_XID, self.set)
        except N.NVMLError_NotSupported:  # "None of the requested eventTypes are registered"
            return KERNEL_LOG
        ecc = supported & (EVENT_SBE | EVENT_DBE)
        if ecc:
            try:
                N.nvmlDeviceRegisterEvents(handle, ecc, self.set)
            except N.NVMLError_NotSupported:
                self.problems.append("GPU %d: ECC events not supported; XIDs only" % gpu["index"])
        return NVML

    def wait(self, timeout_ms: int) -> Optional[Tuple[Dict[str, Any], str, Optional[int]]]:
        """The next event (gpu, kind, xid) or None after ``timeout_ms``; SessionLost on any other error.

        The GPU is found by its handle, without asking NVML about it: a GPU that has just fallen
        off the bus answers nothing more."""
        N = self.N
        try:
            data = N.nvmlEventSetWait_v2(self.set, timeout_ms)
        except N.NVMLError_Timeout:
            return None
        except N.NVMLError as exc:
            raise SessionLost("nvmlEventSetWait_v2: %s" % type(exc).__name__) from None
        gpu = self.by_handle.get(_address(data.device))
        kind = KIND_OF.get(int(data.eventType))
        if gpu is None or kind is None:
            return None
        return gpu, kind, int(data.eventData) if kind == "xid" else None

    def close(self) -> None:
        N = self.N
        if self.set is not None:
            try:
                N.nvmlEventSetFree(self.set)
            except Exception:
                pass
            self.set = None
        try:
            N.nvmlShutdown()
        except Exception:
            pass


# ---- the kernel log --------------------------------------------------------------------------------


class KernelLog:
    """``journalctl --dmesg --follow --output=json``: kernel messages as journald keeps them."""

    def __init__(self, cursor: Optional[str]) -> None:
        argv = ["journalctl", "--dmesg", "--follow", "--output=json", "--no-pager", "--quiet"]
        argv.append("--after-cursor=%s" % cursor if cursor else "--lines=0")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True)
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.buffer = b""

    def poll(self, timeout: float) -> List[Dict[str, Any]]:
        """Journal entries that arrived, waiting at most ``timeout`` seconds for the first."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            raise SessionLost("journalctl exited (%s)" % self.proc.poll())
        self.buffer += chunk
        lines = self.buffer.split(b"\n")
        self.buffer = lines.pop()
        out = []
        for line in lines:
            try:
                entry = json.loads(line.decode("utf-8", "replace"))
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def journal_message(entry: Dict[str, Any]) -> str:
    message = entry.get("MESSAGE", "")
    if isinstance(message, list):  # journald's JSON spells a non-UTF-8 message as a byte array
        message = bytes(b & 0xFF for b in message if isinstance(b, int)).decode("utf-8", "replace")
    return str(message)


def journal_time(entry: Dict[str, Any], fallback: float) -> float:
    try:
        return int(entry["__REALTIME_TIMESTAMP"]) / 1e6
    except (KeyError, ValueError, TypeError):
        return fallback


# ---- the loop --------------------------------------------------------------------------------------


class Watcher:
    def __init__(self, args: argparse.Namespace, clock: Callable[[], float] = time.time) -> None:
        self.args = args
        self.clock = clock
        self.stopping = False
        self.up = False
        self.record = Record(args.state_dir, read_machine_id(args.machine_id_file), socket.gethostname(), clock())
        self.clears: Any = read_clears(args.state_dir)
        self.clears_stamp: Any = self._clears_stamp()
        self.exported_at = 0.0
        self.warned_textfile = False
        self.dirty = False  #: the record changed since it was saved (the journal cursor moved)

    def _clears_stamp(self) -> Any:
        try:
            st = os.stat(os.path.join(self.args.state_dir, CLEARS))
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime)

    def export(self) -> None:
        now = self.clock()
        self.exported_at = now
        directory = self.args.textfile_dir
        if not directory:
            return
        if not os.path.isdir(directory):
            if not self.warned_textfile:
                log(
                    "no textfile directory %s (node_exporter's --collector.textfile.directory): not exported"
                    % directory
                )
                self.warned_textfile = True
            return
        text = textfile(self.record.data, self.clears, self.up, now)
        atomic_write(os.path.join(directory, TEXTFILE), text.encode("utf-8"))

    def save(self) -> None:
        self.record.save(self.clock())
        self.dirty = False
        self.export()

    def note(self, text: str) -> None:
        log(text)
        self.record.problem(self.clock(), text)

    def housekeeping(self) -> None:
        stamp = self._clears_stamp()
        if stamp != self.clears_stamp:
            self.clears_stamp, self.clears = stamp, read_clears(self.args.state_dir)
            self.export()
        elif self.clock() - self.exported_at >= HEARTBEAT_S:
            if self.dirty:
                self.save()
            else:
                self.export()

    def on_event(
        self, gpu: Dict[str, Any], kind: str, xid: Optional[int], source: str, at: float, detail: str = ""
    ) -> None:
        event = self.record.add(gpu["uuid"], kind, xid, at, source, detail)
        log("GPU %s (%s): %s [%s]" % (gpu["index"], gpu["uuid"], event["meaning"], event["action"]))
        self.save()

    def kernel_entries(self, entries: List[Dict[str, Any]], by_bus: Dict[str, Dict[str, Any]]) -> None:
        """XIDs among journal entries, for the GPUs watched through the kernel log; the cursor moves
        on with every entry (saved with the next event or heartbeat)."""
        for entry in entries:
            parsed = catalog.parse_kernel_xid(journal_message(entry))
            if isinstance(entry.get("__CURSOR"), str):
                self.record.data["journal_cursor"] = entry["__CURSOR"]
                self.dirty = True
            if parsed is None:
                continue
            gpu = by_bus.get(parsed.bus_id)
            if gpu is None:
                continue  # a GPU NVML delivers events for, or one NVML does not enumerate
            self.on_event(gpu, "xid", parsed.xid, KERNEL_LOG, journal_time(entry, self.clock()), parsed.text)

    def session(self, N: Any) -> None:
        """One NVML session, until it is lost or the watcher is asked to stop."""
        session = NvmlSession(N)
        kernel: Optional[KernelLog] = None
        try:
            for problem in session.problems:
                self.note(problem)
            for gpu in session.gpus:
                self.record.gpu(gpu["uuid"], gpu["index"], gpu["bus_id"], gpu["name"], gpu["source"])
            by_bus = {g["bus_id"]: g for g in session.gpus if g["source"] == KERNEL_LOG}
            if by_bus and self.args.kernel_log:
                kernel = KernelLog(self.record.data.get("journal_cursor"))
            self.up = True
            self.save()
            log(
                "watching %d GPUs (%s)"
                % (len(session.gpus), ", ".join("%d: %s" % (g["index"], g["source"]) for g in session.gpus))
            )
            watched_by_nvml = any(g["source"] == NVML for g in session.gpus)
            while not self.stopping:
                if watched_by_nvml:
                    got = session.wait(200 if kernel else self.args.wait_ms)
                    if got is not None:
                        gpu, kind, xid = got
                        self.on_event(gpu, kind, xid, NVML, self.clock())
                        continue
                if kernel is not None:
                    self.kernel_entries(kernel.poll(0 if watched_by_nvml else self.args.wait_ms / 1000.0), by_bus)
                elif not watched_by_nvml:
                    time.sleep(self.args.wait_ms / 1000.0)
                self.housekeeping()
        finally:
            self.up = False
            if kernel is not None:
                kernel.close()
            session.close()

    def run(self) -> int:
        try:
            import pynvml as N
        except ImportError as exc:
            log("cannot import pynvml (%s)" % exc)
            return 1
        backoff = 1.0
        self.save()
        while not self.stopping:
            started = self.clock()
            try:
                self.session(N)
            except Exception as exc:  # NVML, the journal, a full disk: begin again, never die
                what = str(exc) if isinstance(exc, SessionLost) else "%s: %s" % (type(exc).__name__, exc)
                if self.clock() - started > BACKOFF_MAX_S:
                    backoff = 1.0  # it ran a good while: begin the backoff anew
                self.note("NVML session lost (%s); again in %.0f s" % (what, backoff))
                self.save()
                self.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        self.save()
        return 0

    def sleep(self, seconds: float) -> None:
        deadline = self.clock() + seconds
        while not self.stopping and self.clock() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - self.clock())))
            self.housekeeping()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleet-gpu-watch", description="Record and export this host's GPU events.")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    parser.add_argument("--textfile-dir", default=DEFAULT_TEXTFILE_DIR, help="'' to export nothing")
    parser.add_argument("--no-kernel-log", dest="kernel_log", action="store_false",
                        help="never read the kernel log (GPUs without NVML events go unwatched)")  # fmt: skip
    parser.add_argument("--wait-ms", type=int, default=1000, help="longest single wait for an event")
    parser.add_argument("--machine-id-file", default="/etc/machine-id")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.state_dir, mode=0o755, exist_ok=True)
    watcher = Watcher(args)

    def stop(signum: int, frame: Any) -> None:
        watcher.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return watcher.run()


if __name__ == "__main__":
    sys.exit(main())
