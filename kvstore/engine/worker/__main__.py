"""``python -m kvstore.engine.worker``: see :func:`kvstore.engine.worker.cli.main`."""

import sys

from kvstore.engine.worker.cli import main

sys.exit(main())
