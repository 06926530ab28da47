"""Engine-owned memory: paged KV pools and the handles that name their blocks."""
