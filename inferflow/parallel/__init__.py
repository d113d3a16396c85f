"""Partitioning a model across devices: layouts, the cost-model planner, torch.distributed glue."""
