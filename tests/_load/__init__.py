"""Tests of meshinit/_load/, one file per module: test_<module>.py."""
