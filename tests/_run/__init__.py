"""Tests of meshinit/_run/, one file per module: test_<module>.py."""
