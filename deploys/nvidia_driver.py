"""pyinfra deploy: the NVIDIA driver (and fabric manager on NVSwitch hosts), pinned and held.

    pyinfra /var/lib/fleet-lab/lab/inventory.py deploys/nvidia_driver.py

Reports hosts that need a reboot (``/var/run/reboot-required``); it never reboots them.
"""

from fleet.operations.host import nvidia_driver

nvidia_driver(_sudo=True)
