"""fleet's multi-node network probe: what one node of an instance spanning hosts sees towards its
leader. Run on a host as the login user (``fleet.facts.node_network.NodeNetwork`` sends it to
``python3 -I - ADDRESS PORT TIMEOUT``); reads only, prints one JSON object and exits 0.

* **The rendezvous** (``PORT`` > 0: a worker node): one TCP connect to ``ADDRESS:PORT``, the
  leader's ``--master-addr``/``--master-port`` where vLLM 0.33's workers join torch.distributed's
  TCPStore (``init_distributed_environment`` in ``vllm/distributed/parallel_state.py`` builds
  ``tcp://master_addr:master_port`` when ``nnodes > 1``). The connect's outcome is told apart by
  the errno the kernel gives (Linux ``connect(2)``):

  - ``open``: it connected: something listens there (the leader's store, once it started);
  - ``refused`` (``ECONNREFUSED``): the leader's kernel answered with a reset: the path works and
    nothing listens yet (a firewall that rejects with a TCP reset or an ICMP port-unreachable
    reads the same; one that drops reads as ``timeout``);
  - ``timeout``: no answer within ``TIMEOUT`` seconds: packets are dropped (a firewall, a host
    that is down or not on that address);
  - ``unreachable`` (``EHOSTUNREACH``, ``ENETUNREACH``, ``EACCES``/``EPERM`` from a local firewall):
    the kernel has no way there;
  - ``unresolved``: the leader's name does not resolve here; ``error``: anything else.

* **The route** towards ``ADDRESS`` (``ip -j route get``, iproute2): the interface, the source
  address and the MTU that applies, the route's own ``mtu`` metric when it has one, else the
  interface's (``/sys/class/net/IF/mtu``). On the leader itself the route is ``local`` (through
  ``lo``); there the interface is the one that holds the address (``ip -j addr``), where the
  other nodes' traffic arrives.

* **RDMA** (InfiniBand or RoCE): every port of every device under ``/sys/class/infiniband`` with
  its ``state`` (``4: ACTIVE``), ``link_layer`` (``InfiniBand``/``Ethernet``) and ``rate``, as
  ``ibstat`` prints them (Linux ``Documentation/ABI/stable/sysfs-class-infiniband``).

Written for Python 3.6 (standard library only, %-formatting).
"""

import errno
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

IB = "/sys/class/infiniband"
UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EACCES, errno.EPERM, errno.EHOSTDOWN)


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def resolve(address: str) -> "tuple[int, str] | str":
    """(family, numeric address) or why the name does not resolve."""
    try:
        infos = socket.getaddrinfo(address, None, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return "%s does not resolve: %s" % (address, exc)
    if not infos:
        return "%s does not resolve" % address
    family, _type, _proto, _name, sockaddr = infos[0]
    return int(family), str(sockaddr[0])


def connect(family: int, address: str, port: int, timeout: float) -> "dict[str, Any]":
    started = time.monotonic()
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    outcome, code, error = "open", None, ""
    try:
        sock.connect((address, port))
    except socket.timeout:
        outcome, error = "timeout", "no answer within %g s" % timeout
    except OSError as exc:
        code = exc.errno
        error = os.strerror(code) if code else str(exc)
        if code == errno.ECONNREFUSED:
            outcome = "refused"
        elif code == errno.ETIMEDOUT:
            outcome = "timeout"
        elif code in UNREACHABLE:
            outcome = "unreachable"
        else:
            outcome = "error"
    finally:
        sock.close()
    return {
        "port": port,
        "outcome": outcome,
        "errno": code,
        "error": error,
        "seconds": round(time.monotonic() - started, 3),
    }


def ip_json(*args: str) -> Any:
    out = subprocess.run(
        ("ip", "-j", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=10
    )
    if out.returncode != 0:
        raise OSError("ip %s: %s" % (" ".join(args), out.stderr.strip()[-200:]))
    return json.loads(out.stdout or "[]")


def holder(address: str) -> "str | None":
    """The interface that holds ``address`` (the leader's own)."""
    for link in ip_json("addr", "show"):
        for info in link.get("addr_info") or []:
            if info.get("local") == address:
                return str(link.get("ifname"))
    return None


def route(address: str) -> "dict[str, Any]":
    answer: "dict[str, Any]" = {"dev": None, "src": None, "type": None, "mtu": None, "route_mtu": None, "error": None}
    try:
        found = ip_json("route", "get", address)
        entry = found[0] if found else {}
        answer["type"] = entry.get("type") or "unicast"
        answer["src"] = entry.get("prefsrc")
        dev = entry.get("dev")
        if answer["type"] == "local":
            dev = holder(address) or dev
        answer["dev"] = dev
        for metric in entry.get("metrics") or []:
            if isinstance(metric, dict) and isinstance(metric.get("mtu"), int):
                answer["route_mtu"] = metric["mtu"]
        if dev:
            answer["mtu"] = int(read("/sys/class/net/%s/mtu" % dev))
    except FileNotFoundError as exc:
        answer["error"] = "no %s here (iproute2)" % (exc.filename or "ip")
    except (OSError, ValueError, IndexError, AttributeError, subprocess.SubprocessError) as exc:
        answer["error"] = str(exc)[:200]
    return answer


def rdma(root: str = IB) -> "dict[str, Any]":
    if not os.path.isdir(root):
        return {"present": False, "ports": [], "error": None}
    ports = []
    try:
        for device in sorted(os.listdir(root)):
            base = os.path.join(root, device, "ports")
            for port in sorted(os.listdir(base), key=lambda p: int(p) if p.isdigit() else 0):
                entry: "dict[str, Any]" = {"device": device, "port": int(port) if port.isdigit() else port}
                for name in ("state", "link_layer", "rate"):
                    try:
                        entry[name] = read(os.path.join(base, port, name))
                    except OSError:
                        entry[name] = None
                ports.append(entry)
    except OSError as exc:
        return {"present": True, "ports": ports, "error": str(exc)[:200]}
    return {"present": bool(ports) or bool(os.listdir(root)), "ports": ports, "error": None}


def main(argv: "list[str]") -> "dict[str, Any]":
    address, port, timeout = argv[0], int(argv[1]), float(argv[2])
    answer: "dict[str, Any]" = {"schema": 1, "status": "ok", "error": None, "address": address, "resolved": None,
              "connect": None, "route": None, "rdma": rdma()}  # fmt: skip
    found = resolve(address)
    if isinstance(found, str):
        answer["route"] = {"dev": None, "src": None, "type": None, "mtu": None, "route_mtu": None, "error": found}
        if port > 0:
            answer["connect"] = {"port": port, "outcome": "unresolved", "errno": None, "error": found, "seconds": 0.0}
        return answer
    family, numeric = found
    answer["resolved"] = numeric
    answer["route"] = route(numeric)
    if port > 0:
        answer["connect"] = connect(family, numeric, port, timeout)
    return answer


if __name__ == "__main__":
    try:
        result = main(sys.argv[1:])
    except Exception as exc:  # answer in the protocol, never a traceback
        result = {"schema": 1, "status": "probe-crashed", "error": "%s: %s" % (type(exc).__name__, exc)}
    print(json.dumps(result))
