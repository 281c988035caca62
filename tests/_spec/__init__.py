"""Tests of meshinit/_spec/, one file per module: test_<module>.py."""
