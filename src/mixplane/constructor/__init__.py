"""The Data Constructor: assembles each rank's batch of a step from the samples loaders send, as the planner's
layout says."""
