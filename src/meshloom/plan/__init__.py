"""Cost model: memory and communication formulas shared by the strategies, tests and planner."""
