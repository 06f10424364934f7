"""Delta snapshots of a pipeline's table, rebuilt from its changelog (docs/snapshots.md)."""
