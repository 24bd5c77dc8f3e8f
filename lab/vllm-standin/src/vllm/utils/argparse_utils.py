"""``FlexibleArgumentParser`` at vLLM 0.33.0's module path (``vllm/utils/argparse_utils.py``).

Like vLLM's: ``--max_model_len`` is read as ``--max-model-len``; anything else is argparse's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from vllm._vendor import vllm_surface


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(vllm_surface.normalize_flag_spelling(argv), namespace)
