"""Maintenance tools: the docs hooks and browser check, the TRL test harness, the tiny-metrics comparison."""
