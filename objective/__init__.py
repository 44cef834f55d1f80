"""The objective: what training minimises (objective/losses.py) and what the run measures
beside it (objective/targets.py: top-1 and top-5 hits of any target; objective/metrics.py:
the metrics.factory contract). Docs: docs/your-model-and-data.md, "Loss and metrics"."""
