"""Tests of meshinit/_report/, one file per module: test_<module>.py."""
