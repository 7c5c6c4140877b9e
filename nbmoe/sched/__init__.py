"""Placement and scheduling: where each weight lives and where each op runs."""
