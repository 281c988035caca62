"""Tests of meshinit/_jax/, one file per module: test_<module>.py."""
