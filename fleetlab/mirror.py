"""Which Debian mirror debootstrap uses: the one this machine's apt already uses.

No mirror host is written in the code. We read apt's own configuration: deb822 files in
``/etc/apt/sources.list.d/*.sources`` and one-line entries in ``/etc/apt/sources.list`` (and
``*.list``), and take the first ``deb`` source that carries the wanted suite itself (not
``-updates`` / ``-security``) with the ``main`` component. ``--mirror`` overrides it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fleetlab.errors import LabError


def _deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    """Yield the fields of each deb822 stanza (comments dropped, continuation lines joined)."""
    fields: dict[str, str] = {}
    key: str | None = None
    for raw in [*text.splitlines(), ""]:
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if fields:
                yield fields
            fields, key = {}, None
            continue
        if raw[0] in " \t" and key is not None:
            fields[key] += " " + raw.strip()
        elif ":" in raw:
            key, _, value = raw.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()


def _from_deb822(text: str, suite: str) -> str | None:
    """The first URI of a ``deb`` stanza that serves ``suite`` with the ``main`` component."""
    for stanza in _deb822_stanzas(text):
        if stanza.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in stanza.get("types", "").split():
            continue
        if suite in stanza.get("suites", "").split() and "main" in stanza.get("components", "").split():
            uris = stanza.get("uris", "").split()
            if uris:
                return uris[0]
    return None


def _from_one_line(text: str, suite: str) -> str | None:
    """The URI of the first ``deb URI suite main...`` line (options in ``[...]`` skipped)."""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        rest = line[4:].strip()
        if rest.startswith("["):
            rest = rest.partition("]")[2].strip()
        parts = rest.split()
        if len(parts) >= 3 and parts[1] == suite and "main" in parts[2:]:
            return parts[0]
    return None


def find_mirror(suite: str, apt_dir: Path = Path("/etc/apt")) -> str:
    """The mirror URI apt uses for ``suite``; raise ``LabError`` saying how to pass one if none."""
    candidates: list[tuple[Path, bool]] = [(p, True) for p in sorted(apt_dir.glob("sources.list.d/*.sources"))]
    candidates.append((apt_dir / "sources.list", False))
    candidates += [(p, False) for p in sorted(apt_dir.glob("sources.list.d/*.list"))]
    for path, deb822 in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        uri = _from_deb822(text, suite) if deb822 else _from_one_line(text, suite)
        if uri:
            return uri
    raise LabError(
        f"No Debian mirror for suite {suite!r} with component 'main' in {apt_dir}/sources.list or "
        f"{apt_dir}/sources.list.d/; pass one with --mirror URL"
    )
