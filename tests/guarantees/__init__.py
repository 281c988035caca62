"""The guarantees that cross every stage: each file names the one it checks."""
