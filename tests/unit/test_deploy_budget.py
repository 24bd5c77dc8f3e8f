"""The deploy's one failure budget (``fleet.deploy.runner.Budget``, Ansible's max_fail_percentage):
what counts as failed, when it is spent, and what the other hosts are told."""

from __future__ import annotations

import pytest

from fleet.deploy.runner import Budget, HostResult


def results(*statuses: str) -> dict[str, HostResult]:
    return {f"h{i}": HostResult(f"h{i}", s, error="boom" if s == "failed" else None) for i, s in enumerate(statuses)}


@pytest.mark.parametrize(
    ("statuses", "fail_percent", "failed", "over"),
    [
        (("changed", "changed", "changed", "changed"), 0, 0, False),
        (("failed", "changed", "changed", "changed"), 0, 1, True),
        (("failed", "changed", "changed", "changed"), 25, 1, False),  # 25 % of 4 is not more than 25 %
        (("failed", "refused", "changed", "changed"), 25, 2, True),
        (("unreachable", "changed", "changed", "changed"), 30, 1, False),
        # a drained host is skipped, not failed: it spends nothing of the budget
        (("skipped", "changed", "changed", "changed"), 0, 0, False),
        (("stopped", "waiting", "unchanged", "would change"), 0, 0, False),
    ],
)
def test_what_spends_the_budget(statuses: tuple[str, ...], fail_percent: int, failed: int, over: bool) -> None:
    budget = Budget(results(*statuses), len(statuses), fail_percent)
    assert (budget.failed, budget.over()) == (failed, over)


def test_over_the_budget_the_others_stop_and_the_message_names_the_failed() -> None:
    budget = Budget(results("failed", "changed", "skipped"), 3, 0)
    budget.stop_others("nothing restarted: the deploy stopped after preflight refusals")
    assert [r.status for r in budget.results.values()] == ["failed", "stopped", "stopped"]
    text = budget.message()
    assert text.startswith("1 host(s) failed, over --fail-percent 0: nothing more was scheduled.\nh0: failed: boom")
    assert "run the deploy again" in text
