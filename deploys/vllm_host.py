"""pyinfra deploy: a vLLM serving host from bare to installed (driver, release venv, units).

    pyinfra /var/lib/fleet-lab/lab/inventory.py deploys/vllm_host.py

Each host's data drives it (its part of the plan: ``fleet.render.part``); its GPUs come from its NVML probe
(a ``gpu`` entry the probe contradicts stops the run before anything is written). A host whose
NVML does not answer yet and has no ``gpu`` entry gets its units from a run after its driver and
release are in place (``fleet deploy`` does that second pass itself). Commands run with sudo. It installs
the units, enabled only when planned from the host's probe (units from a ``gpu`` entry would start
at boot from a plan the probe replaces), and does not start or restart them: ``fleet deploy`` does
that after its preflight, and the rolling engine on a fleet that is already serving.
"""

from pyinfra.context import host

from fleet.operations.host import PATHS, probe, vllm_host
from fleet.render.part import part_of_data

# the host's part of the plan, validated and planned here, before any operation
vllm_host(part=part_of_data(host.name, host.data.dict(), PATHS, probe()), _sudo=True)  # type: ignore[no-untyped-call]
