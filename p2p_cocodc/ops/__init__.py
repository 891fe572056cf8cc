"""Operations: the bootstrap node, status page and table, metrics, sinks, progress, demo, preflight,
compare."""
