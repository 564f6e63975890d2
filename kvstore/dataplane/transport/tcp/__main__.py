"""``python -m kvstore.dataplane.transport.tcp``: the standalone server (:mod:`.standalone`)."""

from __future__ import annotations

import sys

from kvstore.dataplane.transport.tcp.standalone import main

sys.exit(main())
