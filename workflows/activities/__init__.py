"""What a trial's activities share: connections to the services, describing and preparing a
path, the ledger, authorisation, and tensor payloads."""
