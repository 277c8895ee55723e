"""Cost model and layout search: memory, FLOPs, communication and pipeline bubble per layout."""


class PlanError(ValueError):
    """Bad planner input; the message is one line naming the flag or value that is wrong."""
