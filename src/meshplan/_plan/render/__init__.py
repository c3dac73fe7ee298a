"""Renderers of a plan: a rich table, a JSON-ready dict and a PNG. They read plan records and
import nothing above them."""
