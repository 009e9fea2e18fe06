"""Workflows of switchyard."""
