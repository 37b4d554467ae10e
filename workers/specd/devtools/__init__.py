"""Development code outside the serving packages: test helpers, tiny offline checkpoints,
the demo training scripts, the greedy judge and the docs generators."""
