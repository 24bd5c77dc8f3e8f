"""``make_arg_parser`` at vLLM 0.33.0's module path (``vllm/entrypoints/common/cli_args.py``).

vLLM's ``vllm serve`` builds its parser with ``make_arg_parser(FlexibleArgumentParser(...))``; a
tool that wants the host's own vLLM to judge a command line calls the same two names. Here the
arguments come from the vendored 0.33.0 surface (the same one ``vllm serve`` of the stand-in uses).
"""

from __future__ import annotations

import argparse

from vllm._vendor import vllm_surface
from vllm.standin.faults import read_faults
from vllm.version import VLLM_VERSION


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``vllm serve`` argument of the vendored surface to ``parser``; returns it."""
    surface = vllm_surface.build_parser(vllm_surface.load_surface(VLLM_VERSION), allow_abbrev=True)
    unknown = read_faults().unknown_flags  # the lab's "this build has no such flag" fault
    for action in surface._actions:
        if isinstance(action, argparse._HelpAction) or unknown & set(action.option_strings):
            continue
        parser._add_action(action)
    return parser
