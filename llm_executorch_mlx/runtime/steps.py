"""Queue a step's graph and wait for its result, the host thread helping.

On the CPU, with the compiled extension loaded (``attention_kernel.py``), a
step's one-row products are ``gemv`` nodes whose rows the stream thread
shares with whichever host thread is inside ``submit`` or ``wait`` (see
``attention_kernel.cpp``). Elsewhere these are ``mx.async_eval`` and a
plain wait.
"""

from __future__ import annotations

import mlx.core as mx

from . import attention_kernel


def _helping_kernel():
    return attention_kernel.load() if mx.default_device() == mx.cpu else None


def submit(*arrays: mx.array) -> None:
    """``mx.async_eval(*arrays)``."""
    kernel = _helping_kernel()
    if kernel is None:
        mx.async_eval(*arrays)
    else:
        kernel.submit_helping(list(arrays))


def wait(array: mx.array) -> None:
    """Return once a submitted ``array`` is computed."""
    kernel = _helping_kernel()
    if kernel is not None:
        kernel.wait_helping(array)
