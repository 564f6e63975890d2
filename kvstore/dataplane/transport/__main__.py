"""``python -m kvstore.dataplane.transport``: a standalone TCP server over an in-memory backend.

See :func:`kvstore.dataplane.transport.tcp.standalone.main` for the flags.
"""

from __future__ import annotations

import sys

from kvstore.dataplane.transport.tcp.standalone import main

sys.exit(main())
