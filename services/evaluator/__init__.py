"""Evaluator service: compares a candidate path with a reference."""
