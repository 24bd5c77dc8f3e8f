"""The lab as a product: fleet installed from its wheel, outside any checkout, runs ``fleet lab``.

Builds fleet's wheel from this checkout, installs it into a fresh venv in a temporary directory,
and from there (working directory outside the repository) runs ``fleet lab up --hosts 1``,
``fleet lab status``, ``fleet plan`` on the inventory it wrote, and ``fleet lab down``. The
package index must build the vLLM stand-in from the source shipped in the package
(``fleetlab/standin_src``), and the generated inventory must land in the lab's state
directory, not in the working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetlab import lab as lab_ops

from . import conftest
from .conftest import TEST_OCTET, free_octet, require_lab

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.lab


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with fleet installed from its freshly built wheel; its ``bin`` directory."""
    require_lab()
    root = tmp_path_factory.mktemp("fleet-wheel")
    t0 = time.monotonic()
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist"), str(REPO)],
                 cwd=root, env=dict(os.environ))  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("fleet-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = _run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(wheel)],
               cwd=root, env=dict(os.environ))  # fmt: skip
    assert pip.returncode == 0, pip.stderr[-3000:]
    print(f"\nfleet wheel built and installed into a fresh venv in {time.monotonic() - t0:.1f}s")
    yield venv / "bin"


def test_fleet_lab_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    work = tmp_path / "somewhere"  # an operator's working directory: no checkout here
    work.mkdir()
    state_root = tmp_path / "state"
    name = f"whl{os.getpid() % 100000}"
    octet = free_octet(os.getpid() + 37, avoid=frozenset({TEST_OCTET}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{installed}:{env.get('PATH', '')}"
    fleet = str(installed / "fleet")

    where = _run([str(installed / "python"), "-c", "from fleetlab import index; print(index.STANDIN_DIR)"], work, env)
    assert where.returncode == 0, where.stderr
    standin_dir = Path(where.stdout.strip())
    assert standin_dir.is_relative_to(installed.parent) and not standin_dir.is_relative_to(REPO), standin_dir

    conftest._STARTED.append((name, state_root))  # the session's safety net takes it down too
    try:
        t0 = time.monotonic()
        up = _run([fleet, "lab", "up", "--hosts", "1", "--name", name, "--state-root", str(state_root),
                   "--octet", str(octet), "--json"], work, env)  # fmt: skip
        up_s = time.monotonic() - t0
        assert up.returncode == 0, up.stdout + up.stderr
        result = json.loads(up.stdout)
        inventory = Path(result["inventory"])
        assert inventory == (state_root / name / "inventory.py").absolute()
        assert inventory.is_file()
        assert list(work.iterdir()) == []  # nothing generated in the working directory
        wheels = sorted(p.name for p in (state_root / name / "index" / "files").glob("*.whl"))
        assert any(w.startswith("vllm-0.33.0+fleetlab.1-") for w in wheels), wheels
        assert any(w.startswith("prometheus_client-") for w in wheels), wheels

        status = _run([fleet, "lab", "status", "--name", name, "--state-root", str(state_root), "--json"], work, env)
        assert status.returncode == 0, status.stdout + status.stderr
        hosts = json.loads(status.stdout)["hosts"]
        assert len(hosts) == 1 and hosts[0]["ssh"] == "ok"

        plan = _run([fleet, "plan", str(inventory), "--json"], work, env)
        assert plan.returncode == 0, plan.stdout + plan.stderr

        t1 = time.monotonic()
        down = _run([fleet, "lab", "down", "--name", name, "--state-root", str(state_root), "--json"], work, env)
        assert down.returncode == 0, down.stdout + down.stderr
        assert json.loads(down.stdout)["stopped"] == [hosts[0]["name"]]
        assert not inventory.exists()
        print(f"\nfrom the wheel: lab up --hosts 1 {up_s:.1f}s, down {time.monotonic() - t1:.1f}s")
    finally:
        lab_ops.down(name, state_root)
