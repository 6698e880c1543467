"""Build small MLX programs by hand, run them through our runtime.

Op-level tests describe a graph node by node with the schema's own object
API (``mlx_delegate.AddNodeT`` ...), then run it through the same path a .pte
takes: serialize -> ``decode_graph`` -> ``GraphExecutor``.

    g = OpGraph()
    x = g.input(np.ones((2, 3), np.float32))
    y = g.temp()
    g.node(md.NegNodeT, x=x, out=y)
    g.output(y)
    (out,) = g.run()
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from llm_executorch_mlx.runtime import cpu
from llm_executorch_mlx.runtime.dtypes import on_cpu
from llm_executorch_mlx.runtime.plan import Plan
from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.pte.graph import decode_graph, encode_graph
from llm_executorch_mlx.runtime.interp.interpreter import GraphExecutor

NP_TO_SCALAR_TYPE = {
    np.dtype(np.uint8): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2,
    np.dtype(np.int32): 3, np.dtype(np.int64): 4, np.dtype(np.float16): 5,
    np.dtype(np.float32): 6, np.dtype(np.bool_): 11, np.dtype(np.uint32): 28,
}
BF16 = 15


def _meta(shape, scalar_type, dynamic_dims=()):
    m = md.TensorMetaT()
    m.shape = []
    for i, d in enumerate(shape):
        sd = md.ShapeDimT()
        if i in dynamic_dims:
            sd.value, sd.minValue, sd.maxValue = -1, 0, -1
        else:
            sd.value = int(d)
        m.shape.append(sd)
    m.scalarType = scalar_type
    return m


class OpGraph:
    """A hand-built MLX program; slot numbers are assigned when it is run."""

    def __init__(self):
        self._constants: list[tuple[md.TidT, np.ndarray | mx.array]] = []
        self._inputs: list[tuple[md.TidT, np.ndarray]] = []
        self._outputs: list[md.TidT] = []
        self._temps: list[md.TidT] = []
        self._values: list[md.VidT] = []
        self._value_outputs: list[md.VidT] = []
        self._mutable: list[tuple[md.TidT, tuple, int]] = []
        self.chains: list[list] = [[]]
        self._metas = {}

    # -- slots --------------------------------------------------------------

    def constant(self, array) -> md.TidT:
        t = md.TidT()
        self._constants.append((t, array))
        return t

    def input(self, array: np.ndarray, dynamic_dims=()) -> md.TidT:
        t = md.TidT()
        self._inputs.append((t, np.asarray(array)))
        self._metas[id(t)] = (np.asarray(array).shape, NP_TO_SCALAR_TYPE[np.asarray(array).dtype], dynamic_dims)
        return t

    def mutable(self, shape, scalar_type=6) -> md.TidT:
        t = md.TidT()
        self._mutable.append((t, tuple(shape), scalar_type))
        return t

    def temp(self) -> md.TidT:
        t = md.TidT()
        self._temps.append(t)
        return t

    def value(self) -> md.VidT:
        v = md.VidT()
        self._values.append(v)
        return v

    def output(self, slot) -> None:
        if isinstance(slot, md.VidT):
            self._value_outputs.append(slot)
        else:
            self._outputs.append(slot)

    # -- literals -------------------------------------------------------------

    @staticmethod
    def iov(x) -> md.IntOrVidT:
        """An IntOrVid from an int or a VidT."""
        o = md.IntOrVidT()
        if isinstance(x, md.VidT):
            o.vid, o.isVid = x, True
        else:
            o.literal = int(x)
        return o

    @staticmethod
    def fov(x) -> md.FloatOrVidT:
        o = md.FloatOrVidT()
        if isinstance(x, md.VidT):
            o.vid, o.isVid = x, True
        else:
            o.literal = float(x)
        return o

    # -- nodes ----------------------------------------------------------------

    def node(self, cls, chain: int = 0, **fields):
        """Append a node of schema class ``cls`` (e.g. ``md.AddNodeT``)."""
        n = cls()
        for k, val in fields.items():
            if not hasattr(n, k):
                raise AttributeError(f"{cls.__name__} has no field {k}")
            setattr(n, k, val)
        instr = md.InstructionT()
        instr.opType = getattr(md.OpNode, cls.__name__[:-1])
        instr.op = n
        while len(self.chains) <= chain:
            self.chains.append([])
        self.chains[chain].append(instr)
        return n

    def new_chain(self) -> int:
        self.chains.append([])
        return len(self.chains) - 1

    # -- running --------------------------------------------------------------

    def build(self, init_chain: int = -1) -> tuple[md.MLXGraphT, list[mx.array]]:
        order = (
            [t for t, _ in self._constants]
            + [t for t, _ in self._inputs]
            + self._outputs
            + [t for t, _, _ in self._mutable]
            + [t for t in self._temps if t not in self._outputs]
        )
        seen = []
        for t in order:
            if not any(t is s for s in seen):
                seen.append(t)
        for i, t in enumerate(seen):
            t.idx = i
        for i, v in enumerate(self._values):
            v.idx = i
        g = md.MLXGraphT()
        g.version = "test"
        g.numConstantTensors = len(self._constants)
        g.numInputTensors = len(self._inputs)
        g.numOutputTensors = len(self._outputs)
        g.numMutableBufferTensors = len(self._mutable)
        g.numTempTensors = len(seen) - g.numConstantTensors - g.numInputTensors - g.numOutputTensors - g.numMutableBufferTensors
        g.numValues = len(self._values)
        g.instructionChains = []
        for instrs in self.chains:
            c = md.InstructionChainT()
            c.instructions = instrs
            g.instructionChains.append(c)
        g.mainChainIdx = 0
        g.initChainIdx = init_chain

        def slot(idx, kind=md.SlotType.TensorSlot):
            s = md.SlotVariantT()
            s.idx, s.slotType = idx, kind
            return s

        g.inputMap = [slot(t.idx) for t, _ in self._inputs]
        g.outputMap = [slot(t.idx) for t in self._outputs] + [
            slot(v.idx, md.SlotType.IntValueSlot) for v in self._value_outputs
        ]
        g.mutableBufferMap = [slot(t.idx) for t, _, _ in self._mutable]
        metas = [None] * len(seen)
        for t, arr in self._constants:
            a = arr if isinstance(arr, mx.array) else np.asarray(arr)
            st = BF16 if isinstance(a, mx.array) and a.dtype == mx.bfloat16 else NP_TO_SCALAR_TYPE[np.dtype(np.array(a).dtype) if isinstance(a, mx.array) else a.dtype]
            metas[t.idx] = _meta(a.shape, st)
        for t, _ in self._inputs:
            shape, st, dyn = self._metas[id(t)]
            metas[t.idx] = _meta(shape, st, dyn)
        for t, shape, st in self._mutable:
            metas[t.idx] = _meta(shape, st)
        # Temporaries declare nothing, not even the shape the schema requires
        # of a real export's metadata: an output of one keeps the dtype its
        # node computed (the interpreter casts declared outputs only).
        undeclared = md.TensorMetaT()
        g.tensorMeta = [m if m is not None else undeclared for m in metas]
        g.namedSlots = []
        constants = [a if isinstance(a, mx.array) else mx.array(np.asarray(a)) for _, a in self._constants]
        return g, constants

    def executor(self, cache=None, init_chain: int = -1, plan=None) -> GraphExecutor:
        """``plan``: the routes to build with; by default this machine's, as
        a generation would use them (the CPU kernels built if need be)."""
        graph, constants = self.build(init_chain)
        plan = Plan(on_cpu(), cpu.kernels(build=True)) if plan is None else plan
        return GraphExecutor(decode_graph(encode_graph(graph)), constants, cache=cache, plan=plan)

    def run(self, inputs=None, cache=None) -> list:
        """Build, round-trip through the wire format, and execute once."""
        ex = self.executor(cache=cache)
        outs = ex.execute(inputs if inputs is not None else [a for _, a in self._inputs])
        return [np.array(o) if isinstance(o, mx.array) else o for o in outs]
