"""How a ``systemctl stop`` ended (pure): clean, or SIGKILLed after ``TimeoutStopSec``.

``systemctl stop`` returns 0 both when the unit's main process exits on SIGTERM and when systemd
gives up waiting after ``TimeoutStopSec`` and SIGKILLs what is left (systemd.kill(5),
``KillMode=mixed``: the main process got SIGTERM, everything left in the cgroup gets SIGKILL). The
difference is in the unit's ``Result`` (org.freedesktop.systemd1(5)): ``timeout`` after that
SIGKILL (``ActiveState=failed``, ``ExecMainCode=2`` "killed", ``ExecMainStatus=9``), ``success``
after a clean exit (a main process ended by SIGTERM counts as clean for a service).

vLLM's API server does not always exit on SIGTERM (measured on the real engine, docs/real-engine.md):
streams still open at the ``--shutdown-timeout`` deadline can keep uvicorn waiting for their
connections with no limit (``serve_http`` in ``vllm/entrypoints/launchers/launcher.py`` awaits
``uvicorn.Server.shutdown``), and a SIGTERM that arrives while the model loads is swallowed
(``_interrupt_init`` in ``vllm/entrypoints/launchers/api_server/entry.py``: the API server either
deadlocks in the engine handshake or loads and serves). Both end in that SIGKILL: a known outcome
that the rollout journals as the stop step's outcome, followed by the GPU check (the engine core
and workers must be gone with the cgroup).
"""

from __future__ import annotations

from collections.abc import Mapping

#: The unit properties ``stop_outcome`` reads (``systemctl show -p``).
STOP_PROPS = ("Result", "ActiveState", "ExecMainCode", "ExecMainStatus")
#: ``ExecMainCode`` values: the ``si_code`` of the main process's end (``CLD_*``, waitid(2)).
_CLD = {"1": "exited", "2": "killed", "3": "dumped core"}


def stop_outcome(props: Mapping[str, str]) -> str:
    """What the journal says about a finished ``systemctl stop``, from the unit's properties."""
    result = props.get("Result", "")
    code, status = props.get("ExecMainCode", ""), props.get("ExecMainStatus", "")
    how = f"{_CLD.get(code, 'ended')} with status {status}" if status else "ended"
    if result == "timeout":
        return (
            f"stopped by SIGKILL after TimeoutStopSec (Result=timeout; main process {how}): vLLM did not exit "
            "on SIGTERM (streams open past the drain deadline, or a SIGTERM swallowed while the model loaded); "
            "the GPU check follows"
        )
    if result in ("", "success"):
        return "stopped"
    return f"stopped (Result={result}; main process {how})"
