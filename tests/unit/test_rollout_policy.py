"""Rollout policy: defaults, every bad value named with its source and what is allowed, overrides."""

from __future__ import annotations

import pytest

from fleet.errors import FleetError
from fleet.rollout.errors import PolicyError
from fleet.rollout.policy import (
    POLICY_KEYS,
    BatchUnit,
    HookPlace,
    MetricThreshold,
    OnFailure,
    RolloutPolicy,
    parse_policy,
)


def parse(raw: object, **overrides: object) -> RolloutPolicy:
    return parse_policy(raw, source="inventory/prod.py", where="group all", overrides=overrides or None)  # type: ignore[arg-type]


def problems(raw: object, **overrides: object) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        parse(raw, **overrides)
    assert isinstance(exc.value, FleetError)
    return [str(p) for p in exc.value.problems]


def test_defaults() -> None:
    p = parse(None)
    assert p == RolloutPolicy()
    assert p.batches == (1, "25%") and p.on_failure is OnFailure.ROLLBACK and p.unit is BatchUnit.INSTANCE
    assert p.soak_s < p.host_deadline_s <= p.progress_deadline_s


def test_full_policy() -> None:
    p = parse(
        {
            "batches": [1, 2, "25%"],
            "unit": "host",
            "max_unavailable": 2,
            "soak_s": 10,
            "metrics": [{"name": "vllm:num_requests_waiting", "max": 64, "labels": {"engine": "0"}}],
            "hooks": {"drain": "lbctl disable {host}:{port}", "undrain": ["lbctl", "enable", "{host}"]},
            "timeouts": {"health": 300},
            "on_failure": "halt",
        }
    )
    assert p.batches == (1, 2, "25%") and p.unit is BatchUnit.HOST and p.max_unavailable == 2
    assert p.metrics == (MetricThreshold("vllm:num_requests_waiting", None, 64.0, (("engine", "0"),)),)
    assert p.hooks.argv("drain", host="gpu01", instance="vllm-0", port=8000) == ["lbctl", "disable", "gpu01:8000"]
    assert p.hooks.argv("undrain", host="a b; rm -rf /", instance="x", port=1) == ["lbctl", "enable", "a b; rm -rf /"]
    assert p.timeouts.health == 300 and p.timeouts.models == 60
    assert p.on_failure is OnFailure.HALT


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"batches": []}, 'inventory/prod.py: group all: batches=[]: a non-empty list like [1, 2, "25%"]'),
        ({"batches": [0]}, 'batches[0]=0: an integer >= 1 or a percentage "N%" with N from 1 to 100, or -1'),
        ({"batches": [1, "120%"]}, "batches[1]='120%'"),
        ({"max_unavailable": -1}, "max_unavailable=-1: an integer >= 1 or a percentage"),
        ({"unit": "gpu"}, "unit='gpu': one of instance, host"),
        ({"on_failure": "retry"}, "on_failure='retry': one of rollback, halt"),
        ({"orphans": "kill"}, "orphans='kill': one of stop, fail"),
        ({"soak_s": "30"}, "soak_s='30': a number of seconds"),
        (
            {"timeouts": {"helth": 3}},
            "timeouts.helth=3: unknown key; allowed: unit, health, models, completion, metrics",
        ),
        ({"hooks": {"drain": "lb {hostname}"}}, "hooks.drain='lb {hostname}': unknown placeholder(s) ['hostname']"),
        ({"hooks": {"drain": "lb 'open"}}, 'hooks.drain="lb \'open": a command line shlex can split'),
        ({"hooks": {"drain": "lb x", "on": "remote"}}, "hooks.on='remote': one of control, host"),
        ({"hooks": {"drain": "lb x", "on": True}}, "hooks.on=True: one of control, host"),
        ({"hooks": {"drain": ["lb", "a\0b"]}}, "hooks.drain=['lb', 'a\\x00b']: a command without NUL characters"),
        (
            {"hooks": {"drain": "lb x", "where": "host"}},
            "hooks.where='host': unknown key; allowed: drain, undrain, timeout_s, on",
        ),
        ({"metrics": [{"name": "bad name", "max": 1}]}, "metrics[0].name='bad name': a Prometheus metric name"),
        ({"metrics": [{"name": "vllm:x"}]}, "metrics[0]={'name': 'vllm:x'}: needs min or max"),
        ({"metrics": [{"name": "vllm:x", "min": 2, "max": 1}]}, "min must not exceed max"),
        ({"surge": 1}, "surge=1: unknown key; allowed: batches"),
        ({"soak_s": 2000}, "soak_s=2000.0: must be less than host_deadline_s (1800)"),
        ({"host_deadline_s": 5000}, "host_deadline_s=5000.0: must not exceed progress_deadline_s (3600)"),
        ({"probe_interval_s": 40}, "probe_interval_s=40.0: must be less than soak_s (30)"),
        ({"host_deadline_s": 600}, "timeouts.health=1200.0: must not exceed host_deadline_s (600)"),
        ({"completion": {"max_tokens": 0}}, "completion.max_tokens=0: an integer from 1 to 256"),
        ("fast", "rollout='fast': a dict with keys batches"),
    ],
)
def test_bad_values_are_named(raw: object, expected: str) -> None:
    found = problems(raw)
    assert any(expected in p for p in found), found
    assert all(p.startswith("inventory/prod.py: group all: ") for p in found)


def test_every_problem_at_once() -> None:
    assert len(problems({"unit": "x", "on_failure": "y", "batches": ["0%"]})) == 3


def test_overrides_win_and_name_the_command_line() -> None:
    p = parse({"batches": [1, 2], "timeouts": {"health": 100}}, batches=[1, 4], **{"timeouts.models": 5})
    assert p.batches == (1, 4) and p.timeouts.health == 100 and p.timeouts.models == 5
    found = problems({"batches": [1]}, max_unavailable="0%")
    assert found == [
        "command line: override: max_unavailable='0%': an integer >= 1 or a percentage \"N%\" with N from 1 to 100"
    ]
    assert problems({}, batchez=[1]) == [
        "command line: override: batchez=[1]: unknown key; allowed: " + ", ".join(POLICY_KEYS)
    ]


def test_keys_listed_for_the_schema() -> None:
    assert set(POLICY_KEYS) == {f for f in RolloutPolicy.__dataclass_fields__}


def test_policy_from_hosts_one_policy_per_rollout() -> None:
    from fleet.rollout.policy import policy_from_hosts

    same = {"batches": [1, 2]}
    p = policy_from_hosts("inventory/prod.py", {"a": {"rollout": same}, "b": {"rollout": same}}, {"soak_s": 5})
    assert p.batches == (1, 2) and p.soak_s == 5
    assert policy_from_hosts("inventory/prod.py", {"a": {}, "b": {}}) == RolloutPolicy()
    with pytest.raises(PolicyError) as exc:
        policy_from_hosts("inventory/prod.py", {"a": {"rollout": same}, "b": {"rollout": same}, "c": {}})
    assert str(exc.value) == (
        "inventory/prod.py: host c: rollout=None: differs from host a's; one rollout has one policy: "
        "set it on a group every host shares"
    )
    with pytest.raises(PolicyError, match=r"inventory/prod.py: hosts a..b \(2\): unit='x': one of instance, host"):
        policy_from_hosts("inventory/prod.py", {"a": {"rollout": {"unit": "x"}}, "b": {"rollout": {"unit": "x"}}})


def test_policy_round_trips_through_its_inventory_form() -> None:
    from fleet.rollout.policy import policy_to_raw

    p = parse(
        {
            "batches": [1, "10%", -1],
            "metrics": [{"name": "vllm:num_requests_waiting", "max": 8, "labels": {"engine": "0"}}],
            "hooks": {"drain": "lb off {host}", "on": "host"},
            "orphans": "fail",
        }
    )
    assert p.hooks.on is HookPlace.HOST
    assert parse(policy_to_raw(p)) == p


def test_hooks_run_on_the_control_machine_unless_told_otherwise() -> None:
    assert parse(None).hooks.on is HookPlace.CONTROL
    assert parse({"hooks": {"drain": "lb off {host}"}}).hooks.on is HookPlace.CONTROL
    p = parse({"hooks": {"drain": ["hactl", "disable", "be/{instance}", "port {port}"], "on": "host"}})
    assert p.hooks.on is HookPlace.HOST
    # placeholders are filled in within each argument; nothing is split or interpreted by a shell
    assert p.hooks.argv("drain", host="gpu01", instance="vllm-1", port=8001) == [
        "hactl",
        "disable",
        "be/vllm-1",
        "port 8001",
    ]
    # a journal written before ``on`` existed reads back as "control"
    from fleet.rollout.policy import policy_to_raw

    raw = policy_to_raw(parse({"hooks": {"drain": "lb off {host}"}}))
    del raw["hooks"]["on"]
    assert parse(raw).hooks.on is HookPlace.CONTROL
