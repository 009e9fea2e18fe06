"""Clients of switchyard."""
