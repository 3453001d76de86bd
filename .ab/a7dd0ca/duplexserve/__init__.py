"""duplexserve: a serving frontend for full-duplex speech models (Moshi, Hibiki)."""

__version__ = "0.1.0"
