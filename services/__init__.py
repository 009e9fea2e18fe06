"""Services of switchyard."""
