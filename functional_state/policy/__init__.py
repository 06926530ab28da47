"""Policy: what to release under a byte budget (the planner) and the usage it prices against."""

# What users see of this layer (re-exported by `functional_state`); the rest are its modules' names.
from .enforce import apply_plan, enforce_budget
from .planner import LEVERS, ReleaseAction, ReleasePlan, plan_release

__all__ = ["LEVERS", "ReleaseAction", "ReleasePlan", "apply_plan", "enforce_budget", "plan_release"]
