"""Console script ``vllm``: ``vllm serve MODEL [flags]`` and ``vllm --version``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from vllm.standin import args as args_mod
from vllm.standin import log


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = args_mod.split_command(argv)
    if command != "serve":
        sys.stderr.write(f"vllm {command}: not implemented by the fleet lab stand-in\n")
        return 2
    parsed = args_mod.parse_serve(rest)
    defaults = {action.dest: action.default for action in args_mod.serve_parser()._actions}
    log.setup("APIServer")
    from vllm.standin.serve import serve

    return serve(parsed, defaults)


if __name__ == "__main__":
    raise SystemExit(main())
