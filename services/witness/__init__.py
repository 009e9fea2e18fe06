"""The audit witness: a separate service that countersigns metering's audit head."""
