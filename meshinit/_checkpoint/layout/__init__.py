"""How a plan path maps to stored tensors: ``names=``'s targets, their views, the
blocks a device reads from them, and the host side of a parameter's read."""
