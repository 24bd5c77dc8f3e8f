"""Secrets: references to them, telling them apart from ordinary values, and keeping them out of output.

An inventory never holds a secret, only a reference to one (``SecretRef``: ``env:NAME`` or
``file:/path`` on the control machine). Anything that looks like a secret anyway, under any
field and in any type (a string, bytes, a dict or list holding one), is refused at the input
boundary and never echoed. ``redact`` is the one function every output path runs text through
(errors, hints, ``--json``, logs, the ``--debug`` traceback), so a secret that slips past the
boundary is still not printed.

"Looks like a secret" is a heuristic, stated here so it can be reviewed:

* a known credential prefix followed by token characters: ``sk-``/``sk_`` + 16 (OpenAI-style
  keys), and + 8: ``hf_`` (Hugging Face; letters and digits only, so a mirror named
  ``hf-mirror`` or a path ``/srv/hf-cache`` is not one), ``ghp_``/``gho_``/``ghs_``/``github_pat_`` (GitHub),
  ``glpat-`` (GitLab), ``xox?-`` (Slack), ``AKIA`` + 16 (AWS access key ids), ``eyJ`` (a JWT);
* ``Bearer <token>`` and ``user:password@`` inside a URL;
* a run of 20+ letters and digits (no separators) that mixes upper case, lower case and digits,
  the shape of random tokens; all-lower-case hex (git commit ids in cache paths) is not flagged;
* any non-empty value under a field whose name says it is secret (``password``, ``secret``,
  ``token``, ``api_key``, ``apikey``, ``credential``), except reference fields (``*_ref``,
  ``*_file``, ``*_path``).

Public values that have the shape of a random token are not secrets and are shown: an SSH
public key (its base64 blob, which starts with the key type's name, RFC 4253 section 6.6: the
blob must decode to a known type, ``ssh-ed25519``, ``ecdsa-sha2-nistp256``, ...), the key type
names themselves (``sk-ecdsa-sha2-nistp256@openssh.com`` is not an OpenAI key), and SHA256
fingerprints as OpenSSH prints them (``SHA256:`` and 43 base64 characters): an operator must be
able to compare a host key's fingerprints. A private key is still redacted (its base64 starts
with ``openssh-key-v1``'s, or is PEM).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Literal

REDACTED = "<redacted>"

_TOKEN = r"[A-Za-z0-9_\-+/=.]"
_SECRET_PATTERNS = [
    re.compile(rf"(?<![A-Za-z0-9])sk[-_]{_TOKEN}{{16,}}"),
    # a Hugging Face token is hf_ and letters (never hf-): hf-mirror.internal, /srv/hf-cache are not tokens
    re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{8,}"),
    re.compile(rf"(?<![A-Za-z0-9])(?:ghp|gho|ghu|ghs|ghr|github_pat|glpat|npm|pypi)[-_]{_TOKEN}{{8,}}"),
    re.compile(rf"(?<![A-Za-z0-9])xox[abposr]-{_TOKEN}{{8,}}"),
    re.compile(r"(?<![A-Za-z0-9])AKIA[0-9A-Z]{16}"),
    re.compile(rf"(?<![A-Za-z0-9])eyJ{_TOKEN}{{10,}}"),
    re.compile(rf"(?i)\bbearer\s+{_TOKEN}{{8,}}"),
    re.compile(r"(?<=://)[^/@\s:]*:[^/@\s]+(?=@)"),  # user:password@ in a URL
]
_RUN = re.compile(r"[A-Za-z0-9]{20,}")
_KEY_TYPES = ("ssh-rsa", "ssh-dss", "ssh-ed25519", "ssh-ed448", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
              "ecdsa-sha2-nistp521", "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")  # fmt: skip
_KEY_TYPE_NAMES = frozenset((*_KEY_TYPES, *(t.replace("@", "-cert-v01@") if "@" in t else f"{t}-cert-v01@openssh.com"
                                            for t in _KEY_TYPES)))  # fmt: skip
_KEY_TYPE = re.compile("|".join(re.escape(t) for t in sorted(_KEY_TYPE_NAMES, key=len, reverse=True)))
_PUBLIC_KEY = re.compile(r"(?<![A-Za-z0-9+/])AAAA[A-Za-z0-9+/]{16,}={0,2}")
_FINGERPRINT = re.compile(r"(?<![A-Za-z0-9])SHA256:[A-Za-z0-9+/]{43}(?![A-Za-z0-9+/=])")


def _ssh_public_key(text: str) -> bool:
    """Whether base64 ``text`` is an SSH public key blob: a length-prefixed known key type first."""
    try:
        bare = text.rstrip("=")
        blob = base64.b64decode(bare + "=" * (-len(bare) % 4), validate=True)
    except ValueError:
        return False
    size = int.from_bytes(blob[:4], "big") if len(blob) > 4 else 0
    return 0 < size <= 64 and blob[4 : 4 + size].decode("ascii", "replace") in _KEY_TYPE_NAMES


def _public_spans(text: str) -> list[tuple[int, int]]:
    """Where ``text`` holds public key material that only looks random (see the module docstring)."""
    spans = [m.span() for m in _FINGERPRINT.finditer(text)] + [m.span() for m in _KEY_TYPE.finditer(text)]
    return spans + [m.span() for m in _PUBLIC_KEY.finditer(text) if _ssh_public_key(m.group())]


_SECRET_NAME = re.compile(r"(?i)(pass(word|wd|phrase)?|secret|token|api[_-]?key|credential|private[_-]?key)")
_REFERENCE_NAME = re.compile(r"(?i)(_ref|_file|_path)$")


def _random_run(run: str) -> bool:
    return any(c.isupper() for c in run) and any(c.islower() for c in run) and any(c.isdigit() for c in run)


def secret_spans(text: str) -> list[tuple[int, int]]:
    """Where in ``text`` something looks like a secret (start, end), merged and sorted."""
    spans = [m.span() for p in _SECRET_PATTERNS for m in p.finditer(text)]
    spans += [m.span() for m in _RUN.finditer(text) if _random_run(m.group())]
    if spans and ("AAAA" in text or "SHA256:" in text or "ssh-" in text or "ecdsa-" in text):
        public = _public_spans(text)
        spans = [(a, b) for a, b in spans if not any(pa <= a and b <= pb for pa, pb in public)]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


#: How deep ``looks_like_secret`` looks into nested containers (and it never follows a cycle).
MAX_DEPTH = 16


def looks_like_secret(value: object, _depth: int = 0, _seen: frozenset[int] = frozenset()) -> bool:
    """Whether ``value`` is, or holds anywhere inside it, something shaped like a secret.

    Containers nested deeper than ``MAX_DEPTH``, or holding themselves, count as secret: what
    cannot be looked through is not shown.
    """
    if isinstance(value, str):
        return bool(secret_spans(value))
    if isinstance(value, bytes | bytearray):
        return looks_like_secret(bytes(value).decode("utf-8", "replace"))
    if not isinstance(value, dict | list | tuple | set | frozenset):
        return False
    if _depth >= MAX_DEPTH or id(value) in _seen:
        return True
    seen = _seen | {id(value)}
    items = [x for kv in value.items() for x in kv] if isinstance(value, dict) else list(value)
    return any(looks_like_secret(v, _depth + 1, seen) for v in items)


def secret_field(name: str) -> bool:
    """Whether a field of this name holds a secret itself (not a reference to one)."""
    return bool(_SECRET_NAME.search(name)) and not _REFERENCE_NAME.search(name)


def redact(text: str) -> str:
    """``text`` with every secret-shaped part replaced by ``<redacted>``: run all output through this."""
    spans = secret_spans(text)
    if not spans:
        return text
    out, last = [], 0
    for start, end in spans:
        out += [text[last:start], REDACTED]
        last = end
    out.append(text[last:])
    return "".join(out)


def redact_data(data: object) -> object:
    """``redact`` applied to every string (keys too) of JSON-like data, so the JSON stays valid.

    Each distinct string is redacted once per call: the plans of a large fleet repeat the same
    keys, flags and reasons per host (1,000 hosts: 300,000 strings, a few thousand distinct),
    and the patterns over every one of them were half of ``fleet plan --json``'s time.
    """
    done: dict[str, str] = {}

    def walk(value: object) -> object:
        if isinstance(value, str):
            text = done.get(value)
            if text is None:
                text = done[value] = redact(value)
            return text
        if isinstance(value, dict):
            return {walk(k): walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v) for v in value]
        return value

    return walk(data)


class Redacted:
    """Stands in for a secret value wherever a value is kept for display."""

    def __repr__(self) -> str:
        return REDACTED

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Redacted)

    def __hash__(self) -> int:
        return 0


MAX_SHOWN = 120


def shown(value: object, secret: bool = False) -> str:
    """How a value is shown to people: its ``repr``, shortened, with secrets redacted.

    Never raises (a value from an inventory may be any object, with any ``__repr__``).
    """
    if secret or isinstance(value, Redacted) or looks_like_secret(value):
        return REDACTED
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} object>"
    if len(text) > MAX_SHOWN:
        text = text[: MAX_SHOWN - 15] + f"... ({len(text)} chars)"
    return redact(text)


# -- references -----------------------------------------------------------------------------------

_REF = re.compile(r"(env):([A-Za-z_][A-Za-z0-9_]{0,127})|(file):(/[^\x00-\x1f\x7f]{1,4095})")


@dataclass(frozen=True)
class SecretRef:
    """Where a secret lives on the control machine; the value itself never enters an inventory."""

    scheme: Literal["env", "file"]
    target: str

    def __str__(self) -> str:
        return f"{self.scheme}:{self.target}"


def parse_secret_ref(text: str) -> SecretRef | None:
    """``env:NAME`` or ``file:/absolute/path``, or None when ``text`` is not a reference."""
    match = _REF.fullmatch(text)
    if match is None or looks_like_secret(text):
        return None
    if match.group(1):
        return SecretRef("env", match.group(2))
    return SecretRef("file", match.group(4))


SECRET_REF_HELP = (
    "a reference to the key, not the key: env:VARIABLE (read on the control machine) "
    "or file:/absolute/path (readable only by you)"
)
