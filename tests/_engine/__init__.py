"""Tests of meshinit/_engine/, one file per module: test_<module>.py."""
