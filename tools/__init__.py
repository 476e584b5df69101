"""Maintenance tools: the docs hooks and browser check, the TRL test harness, the before/after comparisons of a
restructure (the tiny recipes' metrics, every recipe's ``--plan``)."""
