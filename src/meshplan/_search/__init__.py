"""Layout search: mesh shapes x rules, ranked; measuring a compiled step's collectives."""
