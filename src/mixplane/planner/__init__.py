"""The planner: plans every step centrally from sample metadata, journals it and serves routes and status."""
