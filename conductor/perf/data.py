"""Where the planner finds the public traces and latency profiles.

Precedence: an explicit path (``--data-dir``) beats ``$KVTIER_DATA_DIR``, which beats the default
``../shared/data`` next to the repository root. Nothing is read here; loaders open files when called.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.errors import ConfigError

DATA_DIR_ENV = "KVTIER_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = _REPO_ROOT.parent / "shared" / "data"


def data_dir(explicit: str | Path | None = None) -> Path:
    """Resolve the data directory (flag > environment > default) and check that it exists."""
    if explicit is not None:
        path = Path(explicit)
    elif os.environ.get(DATA_DIR_ENV):
        path = Path(os.environ[DATA_DIR_ENV])
    else:
        path = DEFAULT_DATA_DIR
    if not path.is_dir():
        raise ConfigError(
            f"data directory {path} does not exist (set --data-dir or ${DATA_DIR_ENV})"
        )
    return path


def data_file(relative: str, explicit_dir: str | Path | None = None) -> Path:
    """Path of one file under the data directory; raises :class:`ConfigError` when it is missing."""
    path = data_dir(explicit_dir) / relative
    if not path.is_file():
        raise ConfigError(f"data file {path} is missing")
    return path
