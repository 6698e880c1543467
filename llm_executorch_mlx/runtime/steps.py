"""How a method's step is queued and awaited: plain, or with the host thread helping.

On the CPU, with the extension's products in use (``plan.py``), a decode
step's products and attention are extension ops whose work the stream thread shares
with whichever host thread is inside ``submit`` or ``wait``
(``cpu/shared_work.cpp``).
Otherwise ``submit`` is ``mx.async_eval`` and ``wait`` returns at once
(reading the array waits). The plan chooses, once per program.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx



class Steps(NamedTuple):
    submit: Callable[..., None]  # mx.async_eval(*arrays)
    wait: Callable[[mx.array], None]  # returns once a submitted array is computed


def _no_wait(array: mx.array) -> None:
    pass


PLAIN = Steps(mx.async_eval, _no_wait)


def helped(extension) -> Steps:
    """Steps whose products ``extension``'s host thread helps run."""
    return Steps(lambda *arrays: extension.submit_helping(list(arrays)), extension.wait_helping)
