"""The import DAG (issue 26), checked by import-linter with the contracts in pyproject.toml
(``[tool.importlinter]``): stages in one direction (inventory -> facts -> plan -> render ->
deploy/rollout -> cli), no circles between the modules of any package, and fleet/ never imports
the lab (``fleetlab``) except the ``fleet lab`` command, and the pyinfra operations import nothing
that validates or plans (they take each host's part, ``fleet.render.part.HostPart``). On main
before issue 26 the first two were broken (ten imports up a stage, five circles) and
deploy/reboot.py imported the lab."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--config", str(REPO / "pyproject.toml")], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in done.stdout
