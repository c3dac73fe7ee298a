"""A compiled step measured: its collectives from the HLO, its time, the machine's load."""
