"""Tests of meshinit/_plan/, one file per module: test_<module>.py."""
