"""pyinfra facts fleet reads from hosts (the NVML probe first), and running them on many hosts."""
