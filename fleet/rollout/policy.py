"""The rollout policy the engine runs by: its grammar and types live with the inventory's validation
(``fleet.inventory.policy``), which checks every host's ``rollout`` data before anything runs."""

from __future__ import annotations

from fleet.inventory.policy import (
    GATE_NAMES,
    HOOK_FIELDS,
    POLICY_KEY,
    POLICY_KEYS,
    BatchUnit,
    CompletionProbe,
    GateTimeouts,
    HookPlace,
    Hooks,
    MetricThreshold,
    OnFailure,
    OrphanPolicy,
    PolicyError,
    PolicyProblem,
    RolloutPolicy,
    Size,
    parse_policy,
    policy_from_hosts,
    policy_to_raw,
)

__all__ = [
    "GATE_NAMES",
    "HOOK_FIELDS",
    "POLICY_KEY",
    "POLICY_KEYS",
    "BatchUnit",
    "CompletionProbe",
    "GateTimeouts",
    "HookPlace",
    "Hooks",
    "MetricThreshold",
    "OnFailure",
    "OrphanPolicy",
    "PolicyError",
    "PolicyProblem",
    "RolloutPolicy",
    "Size",
    "parse_policy",
    "policy_from_hosts",
    "policy_to_raw",
]
