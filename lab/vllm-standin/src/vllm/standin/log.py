"""vLLM-style log lines on stderr, and the error type that ends a start.

vLLM 0.33 prints ``(APIServer pid=123) INFO 11-22 05:53:16 [file.py:42] message``. Operators
(and fleet's journal parsers) look for the message parts, so those follow vLLM's wording; the
prefix is kept so the journal looks familiar.
"""

from __future__ import annotations

import logging
import sys
import traceback

_FORMAT = "(%(procname)s pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


class _ProcName(logging.Filter):
    def __init__(self, procname: str) -> None:
        super().__init__()
        self.procname = procname

    def filter(self, record: logging.LogRecord) -> bool:
        record.procname = self.procname
        return True


def setup(procname: str) -> logging.Logger:
    """Configure the ``vllm`` logger for this process (``APIServer`` or ``VllmWorker TP0``)."""
    logger = logging.getLogger("vllm")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    handler.addFilter(_ProcName(procname))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


logger = logging.getLogger("vllm")


class StartupError(Exception):
    """A start refusal: printed as a traceback whose last line is ``<kind>: <message>``.

    ``kind`` is the exception class vLLM raises (``ValueError``, ``AssertionError``,
    ``RuntimeError``...), so ``journalctl`` shows the same last line as a real vLLM.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def print_startup_error(error: StartupError) -> None:
    """Write a traceback-like block ending in ``Kind: message`` to stderr."""
    stack = "".join(traceback.format_tb(error.__traceback__))
    sys.stderr.write("Traceback (most recent call last):\n" + stack + f"{error.kind}: {error.message}\n")
    sys.stderr.flush()
