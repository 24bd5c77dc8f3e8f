"""pyinfra deploy: a vLLM serving host from bare to installed (driver, release venv, units).

    pyinfra /var/lib/fleet-lab/lab/inventory.py deploys/vllm_host.py

Each host's data drives it (see ``fleet.operations.host``). Commands run with sudo. It installs
and enables but does not start or restart the units: ``fleet deploy`` does that after its
preflight, and the rolling engine on a fleet that is already serving.
"""

from fleet.operations.host import vllm_host

vllm_host(_sudo=True)
