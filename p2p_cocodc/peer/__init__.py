"""One region's peer: the node and its parts (lobby, presence, syncs) and regions of several
processes."""
