"""The ledger's database fixtures (SQLite and PostgreSQL, each test its own) for the attacks
on the ledger here."""

from tests.metering.conftest import db_url, migrated_templates, pg_unavailable

__all__ = ["db_url", "migrated_templates", "pg_unavailable"]
