"""Control plane: the conductor (global prefix index, scheduling) and the capacity planner."""
