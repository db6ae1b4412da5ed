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


def reach_alone(module: str, machine: str, examples: int, steps: int) -> dict[str, Any]:
    """:func:`reach` of ``module.machine`` (its counters in ``machine.seen``) in a fresh
    interpreter: what earlier tests left behind in this process (hypothesis' caches, the
    event loop policy) cannot steer the derandomized runs, so the counts are the same
    whichever tests ran before."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import json, importlib\n"
        "from tests.support.machine_reach import reach\n"
        f"m = getattr(importlib.import_module({module!r}), {machine!r})\n"
        f"print(json.dumps(reach(m, m.seen, {examples}, {steps})))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    counts: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return counts
