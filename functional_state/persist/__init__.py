"""Persistence: checkpoints of sessions and tables on orbax."""
