"""The ``fleet`` program defers ``invoke`` (``fleet.cli.defer_import``): paramiko gets it at
once, and it loads only when paramiko uses it (an ssh_config ``Match exec``)."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import json, sys
from fleet.cli import defer_import
defer_import("invoke")
from gevent import monkey
monkey.patch_all()
import fleet.cli.deploy, fleet.deploy.runner  # what `fleet deploy` imports before it connects
import paramiko.config
seen = {"loaded_at_import": sorted(m for m in sys.modules if m.startswith("invoke."))}
run = paramiko.config.invoke.run  # what paramiko calls for a Match exec line
seen["loaded_when_used"] = "invoke.context" in sys.modules and sys.modules["invoke"] is not paramiko.config.invoke
seen["same_function"] = run is sys.modules["invoke"].run
seen["where"] = run.__module__
print(json.dumps(seen))
"""


def test_paramiko_gets_invoke_which_loads_only_when_used() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True, timeout=120)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"loaded_at_import": [], "loaded_when_used": True, "same_function": True,
                    "where": "invoke"}, seen  # fmt: skip


def test_nothing_is_deferred_that_is_imported_already_or_missing() -> None:
    program = (
        "import sys, invoke\nfrom fleet.cli import defer_import\nreal = sys.modules['invoke']\n"
        "defer_import('invoke'); defer_import('fleet_no_such_module')\n"
        "print(sys.modules['invoke'] is real, 'fleet_no_such_module' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == ["True", "False"]
