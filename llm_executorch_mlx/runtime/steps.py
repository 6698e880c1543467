"""How a method's step is queued and awaited: plain, or with the host thread helping.

On the CPU, with the extension's products in use (``plan.py``), a decode
step's products and attention are extension ops whose work the stream thread shares
with whichever host thread is inside ``submit`` or ``wait``
(``cpu/shared_work.cpp``).
Otherwise ``submit`` is ``mx.async_eval`` and ``wait`` returns at once
(reading the array waits). The plan chooses, once per program.

On a GPU a decode step is also queued as soon as it is built, before the
token it feeds on is read (``queue_on_build``): queuing there only hands
work to the device, which then never idles while the host reads a token,
samples and encodes the next step (the sampling is queued after). On the
CPU a step is queued once that token is read: queuing there makes the host
compute, which would stop it building the next step while the stream
thread computes this one.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx


class Steps(NamedTuple):
    submit: Callable[..., None]  # mx.async_eval(*arrays)
    wait: Callable[[mx.array], None]  # returns once a submitted array is computed
    queue_on_build: bool = False  # a decode step queued as soon as it is built (a GPU's)


def _no_wait(array: mx.array) -> None:
    pass


PLAIN = Steps(mx.async_eval, _no_wait)
ON_BUILD = Steps(mx.async_eval, _no_wait, True)


def helped(extension) -> Steps:
    """Steps whose products ``extension``'s host thread helps run."""
    return Steps(lambda *arrays: extension.submit_helping(list(arrays)), extension.wait_helping)
