"""The runtime's error types: one base class, so callers catch one thing."""


class PteError(Exception):
    """A .pte file, its program or a call into it is unusable; the message says why."""


class CacheFullError(PteError):
    """A step would write past the off-graph cache's capacity."""


class NeedsHost(Exception):
    """An op asked to build its step from arrays alone (a compiled trace)
    needs a value on the host for it: it is built op by op instead."""


class UnsupportedNodeError(PteError):
    """The program holds a node this runtime cannot execute on this machine."""
