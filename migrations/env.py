"""Alembic environment for the metering ledger (SQLite and PostgreSQL, same migrations)."""

from __future__ import annotations

import logging.config

from alembic import context
from sqlalchemy import create_engine, pool

from services.metering.db import resolve_url
from services.metering.schema import Base

config = context.config
if config.config_file_name is not None and not config.attributes.get("database_url"):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

url = config.attributes.get("database_url") or context.get_x_argument(as_dictionary=True).get("db")
url = resolve_url(url)


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
