"""Tests of meshinit/_adapters/placement/, one file per module: test_<module>.py."""
