"""The cost model: hardware catalogue, parallelism planner, tiered estimates."""
