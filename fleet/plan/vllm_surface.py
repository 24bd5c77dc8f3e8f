"""The argument surface of ``vllm serve``, rebuilt from vLLM's own parser dump.

``fleet/plan/data/vllm/serve-args-<version>.json`` is a dump of the real ``make_arg_parser`` of
that vLLM release (options, dest, action, nargs, type, choices, default). From it we build an
``argparse`` parser that accepts what that ``vllm serve`` accepts and rejects what it rejects
(removed flags such as ``--swap-space`` fail with ``unrecognized arguments``, as in vLLM).

This module has no dependencies outside the standard library on purpose: the lab's vLLM
stand-in ships a copy of it so that both sides agree on one surface.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data" / "vllm"

_HUMAN_SUFFIX = {
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}


def human_readable_int(value: str) -> int:
    """vLLM's ``human_readable_int``: ``1k`` = 1000, ``1K`` = 1024; plain integers as they are."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())
    if match:
        number, suffix = match.groups()
        return int(float(number) * _HUMAN_SUFFIX[suffix])
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    if value.strip().lower() in ("auto", "-1"):
        return -1
    return human_readable_int(value)


_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "str": str,
    "human_readable_int": human_readable_int,
    "human_readable_int_or_auto": human_readable_int_or_auto,
}


class _EnableDisable(argparse.Action):
    """vLLM 0.33's ``EnableDisableAction``: ``--enable-x``/``--disable-x``/``--no-enable-x``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name = (option_string or "").lstrip("-").replace("_", "-")
        setattr(namespace, self.dest, name == self.dest.replace("_", "-"))


def surface_path(version: str) -> Path:
    return DATA_DIR / f"serve-args-{version}.json"


def known_versions() -> list[str]:
    return sorted(p.name[len("serve-args-") : -len(".json")] for p in DATA_DIR.glob("serve-args-*.json"))


@cache
def load_surface(version: str) -> tuple[dict[str, Any], ...]:
    """The argument records of ``vllm serve`` for ``version``; ``FileNotFoundError`` if unknown."""
    data = json.loads(surface_path(version).read_text())
    return tuple(data["arguments"])


def _typed(choices: Sequence[str], converter: Any) -> list[Any]:
    """The dump's textual choices converted by the flag's type, where each converts."""
    if converter is None:
        return list(choices)
    try:
        return [converter(c) for c in choices]
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return list(choices)


def build_parser(
    arguments: Sequence[dict[str, Any]], prog: str = "vllm serve", allow_abbrev: bool = False
) -> argparse.ArgumentParser:
    """An ``argparse`` parser with exactly the given argument surface.

    ``allow_abbrev`` is off by default: we validate the argv we generate and want full flag
    names; the stand-in turns it on to mirror vLLM, which leaves argparse's default.
    """
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=allow_abbrev, add_help=False)
    parser.add_argument("-h", "--help", action="help")
    for arg in arguments:
        options = list(arg["options"])
        kwargs: dict[str, Any] = {"dest": arg["dest"], "default": arg["default"]}
        action = arg["action"]
        if not options:  # positional (the model tag)
            parser.add_argument(arg["dest"], nargs=arg["nargs"], default=arg["default"])
            continue
        if action == "EnableDisableAction":
            primary = "--" + arg["dest"].replace("_", "-")
            hidden = "--no-" + primary[2:]
            if hidden not in options:
                options.append(hidden)
            parser.add_argument(*options, action=_EnableDisable, nargs=0, **kwargs)
            continue
        if action == "_StoreTrueAction":
            parser.add_argument(*options, action="store_true", **kwargs)
            continue
        if action == "_AppendAction":
            kwargs["action"] = "append"
        if arg["nargs"] not in (None, 0):
            kwargs["nargs"] = arg["nargs"]
        converter = _TYPES.get(str(arg["type"]))
        if converter is not None:
            kwargs["type"] = converter
        if arg["choices"]:
            # the dump writes choices as text; vLLM's are of the flag's type (``--max-lora-rank``'s are
            # the ints of ``MaxLoRARanks``), and argparse compares them after converting the value
            kwargs["choices"] = _typed(arg["choices"], converter)
        parser.add_argument(*options, **kwargs)
    return parser


def normalize_flag_spelling(argv: Sequence[str]) -> list[str]:
    """vLLM treats ``--max_model_len`` as ``--max-model-len``; so do we."""
    out = []
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            token = name.replace("_", "-") + eq + value
        out.append(token)
    return out


class SurfaceError(ValueError):
    """An argv that ``vllm serve`` of that version would refuse; the message is argparse's."""


@cache
def _parser(version: str) -> argparse.ArgumentParser:
    return build_parser(load_surface(version))


def parse_serve_argv(argv: Sequence[str], version: str = "0.33.0") -> argparse.Namespace:
    """Parse the arguments after ``vllm serve`` as that vLLM would; ``SurfaceError`` if refused."""
    parser = _parser(version)
    messages: list[str] = []

    def _error(message: str) -> None:
        messages.append(message)
        raise SurfaceError(f"{parser.prog}: error: {message}")

    original = parser.error
    parser.error = _error  # type: ignore[method-assign,assignment]
    try:
        return parser.parse_args(normalize_flag_spelling(argv))
    finally:
        parser.error = original  # type: ignore[method-assign]


def accepted_flags(version: str = "0.33.0") -> frozenset[str]:
    """Every option string the surface accepts (hidden ``--no-enable-x`` forms included)."""
    flags: set[str] = set()
    for action in _parser(version)._actions:
        flags.update(action.option_strings)
    return frozenset(flags)
