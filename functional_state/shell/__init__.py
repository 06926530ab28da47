"""The imperative shell: the thread-safe `SessionStateManager`, its session handles, and environment config."""
