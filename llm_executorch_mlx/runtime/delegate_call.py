"""How a method's values reach its MLX delegate call, and its outputs come back.

ExecuTorch's runtime binds a ``DelegateCall``'s arguments to the method's
values by value index: the first ``len(inputMap)`` arguments are the MLX
program's inputs, the rest the values its outputs are written to. Those need
not be the method's inputs then outputs in order: the exporter reorders
inputs (a cache's position first), passes constants the method stores itself
(a scalar, a tensor in the program's constant data), and a method may return
a value no delegate writes (one of its inputs, or a constant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import PteError
from .pte.container import Plan, TensorValue

# Where a value comes from at a call: ("input", j) the method's input j,
# ("output", k) the delegate's output k, ("constant", value).
Source = tuple[str, object]


@dataclass(frozen=True)
class DelegateCall:
    """The argument mapping of a method's one delegate call."""

    inputs: tuple[Source, ...]  # per MLX program input: where its value comes from
    outputs: tuple[Source, ...]  # per method output

    @property
    def is_direct(self) -> bool:
        """The method's inputs go in as they are and the delegate's outputs
        are its outputs, in order: nothing to map at a call."""
        return (
            all(s == ("input", j) for j, s in enumerate(self.inputs))
            and all(s == ("output", k) for k, s in enumerate(self.outputs))
        )

    def wrap(self, run: Callable, n_inputs: int) -> Callable:
        """``run(delegate_inputs, last_position_only)`` as a method's call."""
        if self.is_direct and len(self.inputs) == n_inputs:
            return run
        ins, outs = self.inputs, self.outputs

        def call(inputs: list, last_position_only: bool) -> list:
            results = run([_take(s, inputs, None) for s in ins], last_position_only)
            return [_as_output(_take(s, inputs, results)) for s in outs]

        return call


def _take(source: Source, inputs: list, results: list | None):
    kind, where = source
    if kind == "input":
        return inputs[where]
    if kind == "output":
        return results[where]
    return where


def _as_output(x):
    """A method input returned as an output, as the ``mx.array`` every tensor output is."""
    if isinstance(x, (int, float, bool, str, mx.array)) or x is None:
        return x
    if type(x).__module__.startswith("torch"):
        bf16 = str(x.dtype) == "torch.bfloat16"
        x = x.detach().cpu()
        array = mx.array((x.float() if bf16 else x).numpy())
        return array.astype(mx.bfloat16) if bf16 else array
    return mx.array(np.asarray(x))


def map_delegate_call(plan: Plan, args: list[int], n_in: int, n_out: int, constant) -> DelegateCall:
    """Map ``plan``'s delegate call ``args`` onto an MLX program of ``n_in``
    inputs and ``n_out`` outputs; ``constant(TensorValue)`` reads a constant tensor."""
    name = plan.name
    if len(args) != n_in + n_out:
        raise PteError(
            f"{name}'s delegate call passes {len(args)} values, its MLX program takes "
            f"{n_in} inputs and writes {n_out} outputs"
        )
    method_input = {v: j for j, v in reversed(list(enumerate(plan.inputs)))}
    written = {v: k for k, v in enumerate(args[n_in:])}

    def source(value: int, what: str) -> Source:
        if not 0 <= value < len(plan.values):
            raise PteError(f"{name}'s delegate call refers to value {value} out of range")
        if value in method_input:
            return ("input", method_input[value])
        v = plan.values[value]
        if isinstance(v, TensorValue):
            if v.data_buffer_idx > 0:
                return ("constant", constant(v))
            raise PteError(
                f"{name}: {what} is value {value}, a tensor that is neither one of the "
                "method's inputs nor constant data: this runtime runs methods whose one "
                "delegate call reads only those"
            )
        if isinstance(v, list):
            raise PteError(f"{name}: {what} is value {value}, a list: not supported by this runtime")
        return ("constant", v)

    inputs = tuple(source(v, f"the MLX program's input {k}") for k, v in enumerate(args[:n_in]))
    outputs = []
    for m, v in enumerate(plan.outputs):
        # The delegate's write wins over an input of the same value (in-place).
        outputs.append(("output", written[v]) if v in written else source(v, f"output {m}"))
    return DelegateCall(inputs, tuple(outputs))
