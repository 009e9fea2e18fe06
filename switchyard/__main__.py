"""`python -m switchyard` runs the CLI."""

from switchyard.cli import main

raise SystemExit(main())
