"""The NVML probe as a pyinfra fact.

``NvmlProbe`` follows pyinfra's own facts (``pyinfra.facts.*``): ``command()`` gives the shell
command, ``process()`` turns its output into a value. The command ships the self-contained probe
script (``fleet/facts/nvml_probe.py``, package data) in a quoted here-document and runs it with
the host's own Python, so one SSH round trip answers everything; the script needs only
nvidia-ml-py on the host. It always exits 0 and prints one JSON line, which ``process()``
validates into :class:`fleet.facts.hostfacts.HostFacts`.

**Example:**

.. code:: python

    facts = host.get_fact(NvmlProbe)
    facts.status, [g.name for g in facts.gpus]
"""

from __future__ import annotations

import shlex
from functools import cache
from importlib import resources

from pyinfra.api.facts import FactBase

from fleet.facts.hostfacts import HostFacts, parse_probe_output

#: Interpreters tried in order when none is given: the release of vLLM fleet deployed (its venv
#: has nvidia-ml-py, pinned next to vLLM), the venv of older layouts, then the system's python3.
DEFAULT_PYTHONS = ("/opt/fleet/vllm/current/bin/python", "/opt/fleet/vllm/bin/python", "python3")
_END = "FLEET_NVML_PROBE_EOF"


@cache
def probe_script() -> str:
    """The probe script's text (shipped with fleet as package data)."""
    text = resources.files("fleet.facts").joinpath("nvml_probe.py").read_text()
    if _END in text:  # pragma: no cover - guards the here-document
        raise RuntimeError(f"probe script contains the here-document terminator {_END}")
    return text


def probe_command(python: str | None = None) -> str:
    """The shell command that runs the probe: the first interpreter found, the script on stdin."""
    candidates = (python,) if python else DEFAULT_PYTHONS
    pick = " ".join(shlex.quote(c) for c in candidates)
    tried = " ".join(candidates).replace('"', "")
    no_python = '{"schema":1,"status":"no-python","error":{"class":"NoPython","message":"none of: ' + tried + '"}}'
    return (
        f'PY=; for c in {pick}; do if command -v "$c" >/dev/null 2>&1; then PY=$c; break; fi; done; '
        f'if [ -z "$PY" ]; then echo {shlex.quote(no_python)}; exit 0; fi; '
        f"\"$PY\" - <<'{_END}'\n{probe_script()}\n{_END}\n"
    )


class NvmlProbe(FactBase[HostFacts]):
    """
    GPUs, NVLink, PCIe, driver and health of a host through NVML (nvidia-ml-py).

    + python: the interpreter with nvidia-ml-py (default: fleet's vLLM venv, else ``python3``)
    """

    def command(self, python: str | None = None) -> str:
        return probe_command(python)

    def process(self, output: list[str]) -> HostFacts:
        return parse_probe_output(output)
