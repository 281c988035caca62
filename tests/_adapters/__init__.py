"""Tests of meshinit/_adapters/, one file per module: test_<module>.py."""
