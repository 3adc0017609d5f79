"""Choosing the blocks that go: strategies by name, repair-aware costs, budgets, SLEB's oracle."""
