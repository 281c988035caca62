"""Differential fuzzers, and the defects they found kept as plain tests."""
