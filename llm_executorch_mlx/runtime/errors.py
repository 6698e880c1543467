"""The runtime's error types: one base class, so callers catch one thing."""


class PteError(Exception):
    """A .pte file, its program or a call into it is unusable; the message says why."""


class CacheFullError(PteError):
    """A step would write past the off-graph cache's capacity."""


class UnsupportedNodeError(PteError):
    """The program holds a node this runtime cannot execute on this machine."""
