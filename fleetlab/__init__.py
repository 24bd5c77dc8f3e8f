"""The lab: a local fleet of real Linux hosts (systemd-nspawn) with simulated GPUs."""
