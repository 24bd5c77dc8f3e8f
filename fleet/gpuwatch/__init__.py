"""GPUs watched between audits: XID and ECC events, quarantine.

* :mod:`fleet.gpuwatch.catalog`: which XID means what (NVIDIA's Xid catalog) and the quarantine
  rule; pure, and written for Python 3.6 because it also runs on hosts, inside the watcher;
* :mod:`fleet.gpuwatch.watcher`: the program that runs on every GPU host (its own systemd unit),
  carried there with the pynvml fleet was tested with, like the NVML probe;
* :mod:`fleet.gpuwatch.program`: the watcher as one self-contained file to install on a host;
* :mod:`fleet.gpuwatch.record`: the watcher's record and the operators' clears, as fleet reads them.
"""
