"""Communication: how gradients travel: compression, the node topology, the hooked or hierarchical exchange and the
bytes it puts on the wire."""
