"""Process titles as vLLM sets them: ``VLLM::EngineCore``, ``VLLM::Worker_TP1``.

Mirrors ``vllm/utils/system_utils.py`` ``set_process_title``: the title is
``f"{VLLM_PROCESS_NAME_PREFIX}::{name}"`` (prefix ``VLLM`` by default) written with
``setproctitle`` (a dependency of vLLM 0.33.0 and of this stand-in), so ``ps``, ``pgrep -f`` and
``systemctl status`` show the same command lines as on a real host. ``setproctitle`` also sets
the kernel's ``comm`` (truncated to 15 bytes: ``VLLM::EngineCor``). Without ``setproctitle``
vLLM silently keeps the Python command line; the stand-in then sets at least ``comm`` with
``prctl(PR_SET_NAME)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

PR_SET_NAME = 15


def title(name: str) -> str:
    return f"{os.environ.get('VLLM_PROCESS_NAME_PREFIX', 'VLLM')}::{name}"


def set_process_title(name: str) -> None:
    full = title(name)
    try:
        import setproctitle
    except ImportError:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(full.encode()[:15]), 0, 0, 0)
        return
    setproctitle.setproctitle(full)
