"""Moved to `functional_state.policy.planner`; this path stays because code imports it."""

from .policy.enforce import apply_plan, enforce_budget, over_budget
from .policy.planner import LEVERS, ReleaseAction, ReleasePlan, plan_release

__all__ = ["LEVERS", "ReleaseAction", "ReleasePlan", "apply_plan", "enforce_budget", "over_budget", "plan_release"]
