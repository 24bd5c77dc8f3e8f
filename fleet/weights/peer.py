"""A model copy sent directly from one host to another (``fleet stage --fanout``).

No host gets a login on another: fleet, over the SSH connection it holds to each, starts

* on the receiver, as the service user, a one-shot receiver (``RECEIVE``, ``python3 -c``) that
  listens on the host's fleet address at the staging port (``staging.port``), accepts one TCP
  connection from the planned sender's address only, reads a one-time token (32 random bytes,
  ``secrets.token_hex``, given to both ends on stdin, never in argv) and compares it in constant
  time (``hmac.compare_digest``), then writes the stream into the incoming directory under the
  numbered names fleet chose, each exactly its manifest size, fsynced, and answers ``ok``;
* on the sender, as the service user, a sender (``SEND``) that binds its own fleet address (so
  the receiver sees that address: on a shared network namespace the kernel would pick another),
  connects, sends the token, then each file of its verified snapshot in turn, paced to the
  egress limit: a token bucket whose depth is one chunk (it sleeps until the bytes sent fit
  ``rate × elapsed``).

Both print progress lines (``got N`` / ``sent N``) that fleet reads for the live bytes, rate and
ETA. The stream is the files' bytes back to back in the order of the job: both ends know every
name and size from the manifest, so no archive format is needed. What arrives is only data in
fleet's own incoming directory; fleet then verifies it against the manifest exactly as for a
copy from the control machine (``fleet.weights.stage``) before anything is renamed into the
snapshot or ``refs/main`` moves. Python is on every host (fleet's facts already run ``python3``),
so neither end needs a package installed.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import paramiko

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.sshlink import Link, SshError, SshTarget, connect

#: Seconds the receiver waits for its sender to connect, and for each read of the stream.
WAIT_S = 120.0
IDLE_S = 60.0
CHUNK = 1 << 16

RECEIVE = r"""
import hmac, json, os, socket, sys, time
job = json.loads(sys.stdin.readline())
token = job["token"].encode()
family = socket.AF_INET6 if ":" in job["bind"] else socket.AF_INET
srv = socket.socket(family, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    srv.bind((job["bind"], job["port"]))
except OSError as exc:
    sys.stderr.write("cannot listen on %s port %d: %s\n" % (job["bind"], job["port"], exc.strerror or exc))
    sys.exit(3)
srv.listen(4)
print("listening", flush=True)
deadline = time.monotonic() + job["wait_s"]
conn = None
while conn is None:
    left = deadline - time.monotonic()
    if left <= 0:
        sys.stderr.write("no connection from %s within %ds\n" % (job["peer"], job["wait_s"]))
        sys.exit(4)
    srv.settimeout(min(left, 1.0))
    try:
        c, peer = srv.accept()
    except socket.timeout:
        print("waiting", flush=True)  # fleet gone (its channel closed): EPIPE ends the receiver here
        continue
    c.settimeout(job["idle_s"])
    got = b""
    try:
        if peer[0] == job["peer"]:
            while len(got) < len(token):
                part = c.recv(len(token) - len(got))
                if not part:
                    break
                got += part
    except OSError:
        pass
    if peer[0] == job["peer"] and hmac.compare_digest(got, token):
        conn = c
    else:
        print("refused %s" % peer[0], flush=True)
        c.close()
srv.close()
total, last = 0, 0.0
for name, size in job["files"]:
    path = os.path.join(job["incoming"], name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        left = size
        while left:
            try:
                chunk = conn.recv(min(1 << 20, left))
            except OSError as exc:
                chunk, why = b"", str(exc)
            else:
                why = "the sender closed the connection"
            if not chunk:
                sys.stderr.write("%s after %d of %d bytes (%s)\n" % (why, total, job["total"], name))
                sys.exit(5)
            f.write(chunk)
            left -= len(chunk)
            total += len(chunk)
            now = time.monotonic()
            if now - last >= 0.25:
                print("got %d" % total, flush=True)
                last = now
        f.flush()
        os.fsync(f.fileno())
conn.sendall(b"ok")
conn.close()
print("got %d" % total, flush=True)
print("done", flush=True)
"""

SEND = r"""
import json, os, socket, sys, time
job = json.loads(sys.stdin.readline())
family = socket.AF_INET6 if ":" in job["bind"] else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
s.settimeout(job["idle_s"])
try:
    s.bind((job["bind"], 0))
    s.connect((job["to"], job["port"]))
except OSError as exc:
    sys.stderr.write("cannot connect to %s port %d: %s\n" % (job["to"], job["port"], exc.strerror or exc))
    sys.exit(3)
s.sendall(job["token"].encode())
rate, chunk_size = job["rate"], job["chunk"]
start, sent, last = time.monotonic(), 0, 0.0
for rel in job["files"]:
    with open(os.path.join(job["snapshot"], rel), "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            if rate:
                ahead = (sent + len(chunk)) / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
            s.sendall(chunk)
            sent += len(chunk)
            now = time.monotonic()
            if now - last >= 0.25:
                print("sent %d" % sent, flush=True)
                last = now
s.shutdown(socket.SHUT_WR)
ack = s.recv(2)
if ack != b"ok":
    sys.stderr.write("the receiver did not confirm the copy (%r)\n" % ack)
    sys.exit(6)
print("sent %d" % sent, flush=True)
"""


class SenderFailed(FleetError):
    """The sending host stopped mid-copy (or could not start): its receiver may try another."""


@dataclass(frozen=True)
class Seed:
    """Where a receiver's copy comes from: another host holding the verified snapshot."""

    sender: SshTarget
    sender_address: str  #: the sender's fleet address (it binds it; the receiver accepts only it)
    receiver_address: str  #: the receiver's fleet address (it listens there)
    port: int  #: ``staging.port``
    rate: float | None  #: the sender's egress limit, bytes per second
    snapshot: str  #: the snapshot directory on the sender (a store's model directory, ``fleet.weights.store``)
    #: the sender runs as its SSH login user, not the service user: a store host
    #: (``fleet.weights.store``), whose models that user reads and which may have no service user
    as_login: bool = False


def fleet_address(target: SshTarget) -> str:
    """The address fleet reaches the host at (what its receiver binds and its sender binds from)."""
    try:
        infos = socket.getaddrinfo(target.hostname, target.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise FleetError(f"host {target.name}: cannot resolve {target.hostname}: {exc}") from None
    return str(infos[0][4][0])


def _as_user(user: str, script: str) -> str:
    return "cd / && " + ssh_command(["sudo", "-n", "-u", user, "--", "python3", "-c", script])


def _start(client: paramiko.SSHClient, command: str, job: dict[str, object]) -> paramiko.Channel:
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise FleetError("the connection closed")
    chan = transport.open_session(timeout=30)
    chan.exec_command(command)
    chan.sendall((json.dumps(job) + "\n").encode())
    chan.shutdown_write()
    return chan


def _lines(chan: paramiko.Channel, on_line: Callable[[str], None], deadline: float) -> int:
    """Read ``chan``'s stdout a line at a time until it exits: its exit status (-1: closed
    without one, or ``deadline`` passed)."""
    buf = b""
    chan.settimeout(1.0)
    while time.monotonic() < deadline:
        try:
            data = chan.recv(4096)
        except TimeoutError:
            continue
        except (OSError, EOFError):  # closed under us (the other end failed)
            break
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            on_line(line.decode(errors="replace").strip())
    end = min(deadline, time.monotonic() + 10)  # the exit status follows the end of stdout
    while not chan.exit_status_ready() and time.monotonic() < end:
        time.sleep(0.05)
    if not chan.exit_status_ready():
        chan.close()
        return -1
    return chan.recv_exit_status()


def _stderr(chan: paramiko.Channel) -> str:
    out = b""
    while chan.recv_stderr_ready():
        out += chan.recv_stderr(4096)
    return out.decode(errors="replace").strip()[-300:]


def send_from_peer(
    receiver: paramiko.SSHClient,
    seed: Seed,
    files: Sequence[tuple[str, str, int]],
    incoming: str,
    user: str,
    progress: Callable[[int], None],
) -> int:
    """Copy ``files`` ((temporary name, manifest path, size)) from ``seed.sender``'s snapshot into
    ``incoming`` on the receiver; the bytes received. ``SenderFailed`` when the sender could not
    send them all, ``FleetError`` when the receiver failed."""
    token = secrets.token_hex(32)
    total = sum(size for _n, _p, size in files)
    deadline = time.monotonic() + WAIT_S + IDLE_S + (total / seed.rate if seed.rate else 0) * 2 + total / (1 << 20)
    recv_job = {
        "bind": seed.receiver_address, "port": seed.port, "peer": seed.sender_address, "token": token,
        "incoming": incoming, "files": [[n, size] for n, _p, size in files], "total": total,
        "wait_s": WAIT_S, "idle_s": IDLE_S,
    }  # fmt: skip
    rchan = _start(receiver, _as_user(user, RECEIVE), recv_job)
    first: list[str] = []
    try:
        _until_listening(rchan, first)
    except FleetError:
        rchan.close()
        raise
    sender_error: list[str] = []
    sent = [0]

    def run_sender() -> None:
        try:
            client = connect(seed.sender)
        except SshError as exc:
            sender_error.append(f"cannot reach the sender {seed.sender.name}: {exc.reason}")
            rchan.close()
            return
        link = Link(seed.sender.name, client)
        watch = link.hold(deadline - time.monotonic())
        try:
            send_job = {
                "bind": seed.sender_address, "to": seed.receiver_address, "port": seed.port, "token": token,
                "snapshot": seed.snapshot, "files": [p for _n, p, _s in files], "rate": seed.rate,
                "chunk": CHUNK, "idle_s": IDLE_S,
            }  # fmt: skip
            command = "cd / && " + ssh_command(["python3", "-c", SEND]) if seed.as_login else _as_user(user, SEND)
            chan = _start(client, command, send_job)

            def heard(line: str) -> None:
                if line.startswith("sent "):
                    sent[0] = int(line.split()[1])

            rc = _lines(chan, heard, deadline)
            if rc != 0:
                why = _stderr(chan) or ("the connection to it dropped" if rc == -1 else f"exit {rc}")
                sender_error.append(f"the sender {seed.sender.name} failed after {sent[0]} bytes: {why}")
        except (FleetError, paramiko.SSHException, OSError, EOFError) as exc:
            sender_error.append(f"the sender {seed.sender.name} failed after {sent[0]} bytes: {exc}")
        finally:
            if sender_error:  # the receiver would wait for it: closing its channel ends it (EPIPE)
                rchan.close()
            link.release(watch)
            link.close()

    thread = threading.Thread(target=run_sender, name=f"send-{seed.sender.name}", daemon=True)
    thread.start()
    got = [0]

    def landed(line: str) -> None:
        if line.startswith("got "):
            got[0] = int(line.split()[1])
            progress(got[0])

    rc = _lines(rchan, landed, deadline)
    why = _stderr(rchan)
    if rc != 0:
        rchan.close()  # the sender's connection is refused or reset: it ends too
    thread.join(timeout=IDLE_S + 30)
    if sender_error:
        raise SenderFailed(sender_error[0])
    if rc != 0:
        raise FleetError(f"receiving from {seed.sender.name} exited {rc}: {why or 'no reason given'}")
    return got[0]


def _until_listening(chan: paramiko.Channel, seen: list[str]) -> None:
    buf = b""
    chan.settimeout(WAIT_S)
    while b"\n" not in buf:
        try:
            data = chan.recv(4096)
        except TimeoutError:
            data = b""
        if not data:
            raise FleetError(f"the receiver did not start: {_stderr(chan) or 'no reason given'}")
        buf += data
    line = buf.split(b"\n", 1)[0].decode(errors="replace").strip()
    seen.append(line)
    if line != "listening":
        raise FleetError(f"the receiver did not start: {line!r}")
