#!/usr/bin/env bash
# Install everything fleet needs on a fresh Debian/Ubuntu machine: system packages (apt) and a
# virtual environment at .venv with fleet and its development tools (pip). Mirrors and package
# indexes come from this machine's own apt and pip configuration.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# systemd-analyze (unit checks), systemd-nspawn + debootstrap (the lab), gcc (the lab's NVML
# library), iproute2 and the ssh client (lab networking and debugging), python3-venv, prometheus
# (the server and promtool: `fleet monitor export` output is checked and exercised by the tests),
# dpkg-dev and gnupg (the lab's signed apt repository: dpkg-scanpackages, gpg), chromium (the
# audit tests render the HTML report in a real headless browser), nftables (the lab's air gap),
# haproxy and socat (the lab's load balancer, `fleet lb export` checked with `haproxy -c`, its
# admin socket), tmux (`fleet status` is tested in a real terminal, its screen read back), libpq5
# (psycopg's libpq, for a shared PostgreSQL journal) and postgresql (the server the journal tests
# start a private cluster of).
APT_PACKAGES="systemd systemd-container debootstrap gcc libc6-dev iproute2 openssh-client python3-venv ca-certificates prometheus dpkg-dev gnupg chromium nftables haproxy socat tmux libpq5 postgresql"
missing=""
for pkg in $APT_PACKAGES; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    echo "installing system packages:$missing"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
echo "fleet installed: $(.venv/bin/fleet --version)"
