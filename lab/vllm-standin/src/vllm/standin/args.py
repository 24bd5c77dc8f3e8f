"""The ``vllm`` command line, parsed with vLLM 0.33.0's own argument surface.

The surface (``vllm/_vendor/vllm_surface.py`` + its JSON dump) is copied from fleet into the
wheel at build time, so fleet and the stand-in accept and refuse exactly the same flags. Like
vLLM, ``vllm serve`` uses argparse with abbreviations allowed, and an unknown or removed flag
ends with the top-level parser's ``vllm: error: unrecognized arguments: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from vllm._vendor import vllm_surface
from vllm.standin.faults import drop_unknown_flags
from vllm.version import VLLM_VERSION, __version__

SUBCOMMANDS = ("chat", "complete", "serve", "bench", "collect-env", "run-batch", "download-kernels")
TOP_USAGE = "usage: vllm [-h] [-v] {" + ",".join(SUBCOMMANDS) + "} ...\n"


def version_line() -> str:
    """What ``vllm --version`` prints: the version first (tools split on whitespace)."""
    return f"{__version__} (fleet lab stand-in, not vLLM)"


def _top_error(message: str) -> NoReturn:
    sys.stderr.write(TOP_USAGE + f"vllm: error: {message}\n")
    raise SystemExit(2)


def serve_parser() -> argparse.ArgumentParser:
    """argparse parser of ``vllm serve`` built from the vendored 0.33.0 surface."""
    surface = vllm_surface.load_surface(VLLM_VERSION)
    parser: argparse.ArgumentParser = vllm_surface.build_parser(surface, prog="vllm serve", allow_abbrev=True)
    return drop_unknown_flags(parser)


def parse_serve(argv: Sequence[str]) -> argparse.Namespace:
    """Parse what follows ``vllm serve``; exits 2 like vLLM on anything it would refuse.

    Unknown options are collected by the ``serve`` sub-parser and reported by the top-level
    ``vllm`` parser, which is why vLLM's message starts with ``vllm: error:``.
    """
    parser = serve_parser()
    args, extras = parser.parse_known_args(vllm_surface.normalize_flag_spelling(argv))
    if extras:
        _top_error("unrecognized arguments: " + " ".join(extras))
    if args.config:
        parser.error("--config (YAML option files) is not implemented by the fleet lab stand-in")
    return args


def model_of(args: argparse.Namespace) -> str:
    """The model to serve: the positional tag, else ``--model`` (with vLLM's deprecation)."""
    if args.model_tag:
        return str(args.model_tag)
    return str(args.model)


def split_command(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``(subcommand, rest)``; handles ``--version``/``-v``/``-h`` itself."""
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(TOP_USAGE + "\nvLLM CLI (fleet lab stand-in, not vLLM)\n")
        raise SystemExit(0 if argv else 2)
    if argv[0] in ("-v", "--version"):
        sys.stdout.write(version_line() + "\n")
        raise SystemExit(0)
    command = argv[0]
    if command not in SUBCOMMANDS:
        choices = ", ".join(repr(c) for c in SUBCOMMANDS)
        _top_error(f"argument subparser: invalid choice: {command!r} (choose from {choices})")
    return command, list(argv[1:])
