"""The planner, in three rooms: ``predict`` (a layout's step time and memory from a
traced step), ``search`` (candidate layouts, ranked, with their verdicts) and ``measure``
(a compiled step's collectives and time, and the machine's load)."""
