"""Router service: the OIP front door."""
