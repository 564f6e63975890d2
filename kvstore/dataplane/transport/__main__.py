"""``python -m kvstore.dataplane.transport``: a standalone TCP server over an in-memory backend.

See :func:`kvstore.dataplane.transport.tcp.main` for the flags.
"""

from __future__ import annotations

import sys

from kvstore.dataplane.transport.tcp import main

sys.exit(main())
