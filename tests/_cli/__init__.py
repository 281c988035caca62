"""Tests of meshinit/_cli/, one file per module: test_<module>.py."""
