"""Metering service: the only writer of the SQL ledger."""
