"""`python -m services.witness`: serve the audit witness (services/witness/witness_server.py)."""

import sys

from services.witness.witness_server import main

sys.exit(main())
