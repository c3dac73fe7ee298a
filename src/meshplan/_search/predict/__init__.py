"""A layout's predicted step time and memory: the traced step, its memory, its cost."""
