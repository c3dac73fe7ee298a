"""Orbax checkpoints that store logical names and restore onto any mesh."""
