"""The vLLM release operations on a lab host through the plain pyinfra CLI: the release venv
comes from the lab's package index only, a second run changes nothing, a new release flips
``current`` and keeps the previous one for rollback, and old releases are pruned."""

from __future__ import annotations

import json

import pytest

from fleet.facts.nvml import NvmlProbe, probe_command

from .conftest import LabFleet
from .deploying import host_run, pyinfra

pytestmark = pytest.mark.lab

ROOT = "/opt/fleet/vllm"


def _links(lab: LabFleet) -> tuple[str, str, list[str]]:
    """(current, previous, release directories) on the host."""
    _rc, out, _err = host_run(
        lab,
        f'echo "$(readlink {ROOT}/current)"; echo "$(readlink {ROOT}/previous)"; ls -1 {ROOT}/releases | tr "\\n" " "',
    )
    current, previous, releases = [*out.split("\n"), "", "", ""][:3]
    return current.strip(), previous.strip(), sorted(releases.split())


def _index_url(lab: LabFleet) -> str:
    text = lab.opts.inventory.read_text()
    start = text.index("'pip_index_url': '") + len("'pip_index_url': '")
    return text[start : text.index("'", start)]


def _nvml_answers(lab: LabFleet) -> bool:
    """Whether the host's NVML answers fleet's probe (which carries its pynvml: no release needed)."""
    rc, out, err = host_run(lab, probe_command())
    assert rc == 0, err
    return NvmlProbe().process(out.splitlines()).ok


def _idle(lab: LabFleet) -> None:
    """No vLLM unit runs (earlier tests may have restarted the shared host: enabled units start at
    boot). These tests are about an idle host; on one whose units run, the release and files are
    staged for the rolling engine instead (tests/lab/test_rollout_config_lab.py)."""
    host_run(lab, "sudo systemctl stop 'fleet-vllm-*.service'")


def test_release_from_the_lab_index_and_a_second_run_changes_nothing(bare_lab: LabFleet) -> None:
    _idle(bare_lab)
    nvml_before = _nvml_answers(bare_lab)
    first = pyinfra(bare_lab, "vllm_host.py")
    assert first.returncode == 0, first.output
    current, _prev, releases = _links(bare_lab)
    assert current.startswith("releases/vllm-0.33.0-py3.") and current.removeprefix("releases/") in releases
    rc, marker, _err = host_run(bare_lab, f"cat {ROOT}/current/.fleet-release.json")
    assert rc == 0 and json.loads(marker)["index_url"] == _index_url(bare_lab)
    # Nothing but the inventory's index: no pip configuration on the host could add another.
    rc, conf, _err = host_run(bare_lab, f"{ROOT}/current/bin/pip config list; env | grep -c '^PIP_' || true")
    assert conf.split() == ["0"]
    rc, versions, _err = host_run(
        bare_lab, f"{ROOT}/current/bin/python -c 'import importlib.metadata as m; print(m.version(\"vllm\"), "
        "m.version(\"nvidia-ml-py\"))'",
    )  # fmt: skip
    vllm_version, nvml_version = versions.split()
    assert vllm_version.split("+")[0] == "0.33.0" and nvml_version == "13.615.71"  # the stand-in: 0.33.0+fleetlab.N
    rc, env_mode, _err = host_run(bare_lab, "stat -c '%U %a' /etc/fleet/vllm-0.env")
    assert env_mode.strip() == "root 600"
    # Where NVML answers only now (a driver loaded between the runs: it takes a restart), the next
    # run plans the units from the probe instead of the gpu entry (GPUs by UUID): the plain CLI
    # converges in one more run (`fleet deploy` does it in the same run). The probe carries its
    # pynvml, so a loaded driver answers before the first release: one run is enough then.
    second = pyinfra(bare_lab, "vllm_host.py")
    if not nvml_before and _nvml_answers(bare_lab):
        assert second.returncode == 0 and second.changed, second.output
        second = pyinfra(bare_lab, "vllm_host.py")
    assert second.unchanged, second.output


def test_new_release_flips_current_keeps_previous_and_prunes(bare_lab: LabFleet) -> None:
    _idle(bare_lab)
    url = _index_url(bare_lab)
    first, _prev, _rel = _links(bare_lab)
    # Same index, spelled differently: a different input, so a different release by content.
    second_run = pyinfra(bare_lab, "vllm_host.py", f"pip_index_url={url.rstrip('/')}")
    assert second_run.returncode == 0 and second_run.changed, second_run.output
    second, previous, releases = _links(bare_lab)
    assert second != first and previous == first and len(releases) == 2
    third_url = url.replace("127.0.0.1", "localhost")
    third_run = pyinfra(bare_lab, "vllm_host.py", f"pip_index_url={third_url}", "releases_kept=2")
    assert third_run.returncode == 0, third_run.output
    third, previous, releases = _links(bare_lab)
    assert previous == second and third not in (first, second)
    assert sorted(releases) == sorted([second.removeprefix("releases/"), third.removeprefix("releases/")])
