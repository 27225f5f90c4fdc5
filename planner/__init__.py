"""planner: choosing how to split the work of a jitted program over a mesh (not implemented yet)."""
