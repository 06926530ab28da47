"""Policy: what to release under a byte budget (the planner) and the usage it prices against."""
