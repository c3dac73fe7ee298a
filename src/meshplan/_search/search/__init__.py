"""Layouts searched: candidates, rule records, ranking, role verdicts and results."""
