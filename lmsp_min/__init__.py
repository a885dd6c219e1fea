"""lmsp-min: the LMSP 1.0 local model service protocol over HTTP/1.1.

The protocol side knows nothing of numpy: it validates requests, drives the
engine's async generation and turns what it yields into LMSP events.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`lmsp_min.serve`, `lmsp_min.Service`, `lmsp_min.ServiceConfig`: imported on first use,
    so that commands which do not serve (pull, models) do not load the server."""
    if name in ("serve", "Service", "ServiceConfig"):
        from lmsp_min import service

        return getattr(service, name)
    raise AttributeError(f"module 'lmsp_min' has no attribute {name!r}")
