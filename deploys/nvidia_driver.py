"""pyinfra deploy: the NVIDIA driver (and fabric manager on NVSwitch hosts), pinned and held.

    pyinfra /var/lib/fleet-lab/lab/inventory.py deploys/nvidia_driver.py

Reports hosts that need a reboot (``/var/run/reboot-required``); it never reboots them.
"""

from pyinfra.context import host

from fleet.operations.host import nvidia_driver
from fleet.render.part import driver_settings, spec_of

nvidia_driver(driver=driver_settings(spec_of(host.name, host.data.dict())), _sudo=True)  # type: ignore[no-untyped-call]
