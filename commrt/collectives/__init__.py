"""Collective algorithms: pure schedules (algorithms.py) and their execution (ops.py)."""
