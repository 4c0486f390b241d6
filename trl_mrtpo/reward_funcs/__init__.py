"""Task kits: reward functions (TRL signature), info-block builders and dataset adapters, one module per task."""
