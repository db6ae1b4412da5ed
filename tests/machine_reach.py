"""Run a hypothesis state machine for its reach: the counts of what its rules reached."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test


def reach(
    machine: type[RuleBasedStateMachine], seen: dict[str, int], examples: int, steps: int
) -> dict[str, Any]:
    """Clear ``seen`` (the machine's class-level counters), run ``machine`` derandomized (the
    same runs every time: a reach test must not depend on luck), and return the counts."""
    seen.clear()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    return dict(seen)
