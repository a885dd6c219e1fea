"""Where lmsp-min keeps things on disk.

`LMSP_HOME`, when set, holds everything (models in `$LMSP_HOME/models`, data in
`$LMSP_HOME/data`). Otherwise models live in the user's cache directory (they can
always be fetched again) and the database in the user's data directory (it holds
what clients were told is stored, so it must not sit in a cache).
"""

import os
from pathlib import Path


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    return Path(value) if value else Path.home() / fallback


def models_dir() -> Path:
    """The model store: every `.gguf` here is served."""
    home = os.environ.get("LMSP_HOME")
    if home:
        return Path(home) / "models"
    return _xdg("XDG_CACHE_HOME", ".cache") / "lmsp-min" / "models"


def data_dir() -> Path:
    """The default `--data-dir`: the SQLite database of responses, tasks and events."""
    home = os.environ.get("LMSP_HOME")
    if home:
        return Path(home) / "data"
    return _xdg("XDG_DATA_HOME", ".local/share") / "lmsp-min"
