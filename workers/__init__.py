"""Worker side: one process per disjoint set of physical cores, each running its own engine."""
