"""lmsp-min: the LMSP 1.0 local model service protocol over HTTP/1.1.

The protocol side knows nothing of numpy: it validates requests, drives the
engine's async generation and turns what it yields into LMSP events.
"""

__version__ = "0.1.0"
