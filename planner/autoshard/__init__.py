"""Graph auto-parallel: trace a PyTorch module's operator graph, choose each operator's sharding on a device mesh
by integer programming, split it into pipeline stages, and write the result as DTensor placements.

torch is imported only by `planner.autoshard.trace` and only when a module is traced, so the planner core stays
torch-free.
"""
