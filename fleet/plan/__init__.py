"""The serving plan: the pure planner, plans per inventory, and vLLM's argument surface."""
