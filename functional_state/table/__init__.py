"""The table: `ManagerState` (the LRU map of sessions, with named nodes and counters), its kept ledger, the pure
verbs over it, `step`, and which engine blocks a change released."""
