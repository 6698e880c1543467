"""The op table: one builder per MLX node kind, registered with ``@op``.

A builder takes the decoded node (a ``...NodeT`` of the schema) and the
``BuildContext`` and returns ``run(frame)``, a closure that reads its inputs
from the frame and writes its outputs back. Everything that can be resolved
at load (slot indices, literals, dtypes, axis normalisation of static shapes)
is resolved in the builder, not in the closure.
"""

from __future__ import annotations

from typing import Callable

BUILDERS: dict[str, Callable] = {}


def op(*names: str):
    """Register a builder for one or more node kinds (schema table names)."""

    def register(builder):
        for name in names:
            BUILDERS[name] = builder
        return builder

    return register
