"""Rollout and learner roles, versioned weights, the trajectory schedule; local and Ray back-ends."""
