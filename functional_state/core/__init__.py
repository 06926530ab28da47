"""Core values: the pytree declaration, `StateObject` and its shipped types, `SessionState` and fork policies."""
