"""Memory: extents of one array, the alias registry, the accounting walk, parking to host and back, buffer
holders, byte budgets and pool keys. Imports nothing else of the package but `errors`."""
