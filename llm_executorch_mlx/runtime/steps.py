"""How a method's step is queued and awaited: plain, or with the host thread helping.

On the CPU, with the shared GEMV in use (``cpu.kernels()``), a decode step's
products and attention are extension ops whose work the stream thread shares
with whichever host thread is inside ``submit`` or ``wait``
(``cpu/shared_work.cpp``).
Otherwise ``submit`` is ``mx.async_eval`` and ``wait`` returns at once
(reading the array waits). Chosen once per method, at load.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx

from .cpu import CpuKernels


class Steps(NamedTuple):
    submit: Callable[..., None]  # mx.async_eval(*arrays)
    wait: Callable[[mx.array], None]  # returns once a submitted array is computed


def _no_wait(array: mx.array) -> None:
    pass


PLAIN = Steps(mx.async_eval, _no_wait)


def steps_for(kernels: CpuKernels) -> Steps:
    """Plain steps, or helped ones where ``kernels`` use the shared GEMV."""
    if not kernels.gemv.on:
        return PLAIN
    helping = kernels.extension
    return Steps(lambda *arrays: helping.submit_helping(list(arrays)), helping.wait_helping)
