"""Sharding plans: explain (records), check (problems) and the renderers (table, JSON, PNG)."""
