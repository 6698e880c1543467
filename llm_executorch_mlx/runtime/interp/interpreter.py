"""Runs an MLX program: each node prepared once, each call a list of closures.

A call works on a *frame*, one Python list holding every slot the program
names: tensors at their Tid (constants, inputs, outputs, mutable buffers,
temps), then scalar values at ``num_tensors + vid``, then literals the nodes
carry (so a node reads a literal and a dynamic value the same way), then host
copies of inputs. At load each node becomes a closure ``run(frame)`` with its
slot indices and literals already resolved; a call copies the template frame,
binds inputs, and runs the closures. Building the MLX graph is lazy: nothing
here waits on the device except the nodes whose semantics need a host value
(``ItemIntNode``, an ``UpdateAndAttendNode`` whose position is not an input).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from ..dtypes import mlx_dtype, on_cpu, scalar_type_name
from ..errors import PteError
from ..pte._schema import mlx_delegate as md
from ..plan import Plan
from ..pte.graph import node_name, tensor_fields
from . import compiled_runs
from .compiled_runs import CompiledChain, run_checked
from .decode_blocks import plan_decode_block
from .fusion import GROUP, plan_residual_add, plan_swiglu, try_fuse
from .grouping import plan_group
from .int32 import clamp_int32
from .ops import BUILDERS
from .ops.attention import ROTATED, plan_rotated_attention
from .ops.nn import build_addmm_last_row
from .layout import GATHER
from .ops.quant import build_quantized_matmul_last_row, plan_quantized_gather
from .pairs import try_fuse_pair

Run = Callable[[list], None]

class BuildContext:
    """What a node builder sees at load: slot resolution and shared services.

    Builders (``ops``) call these to turn schema fields into frame indices, so
    the closures they return only index a list.
    """

    def __init__(self, graph: md.MLXGraphT, cache=None, dtype_map=None, constants=(), plan=None, layouts=None,
                 collectives=None):
        self.graph = graph
        self.constants = list(constants)  # for load-time rewrites (fusion.py)
        self.cache = cache
        self.plan = plan or Plan(on_cpu())  # which route each op takes (plan.py)
        # {slot: Layout} for the quantized weights held in another layout than
        # MLX's, which only the extension's products read (program.py)
        self.layouts = layouts or {}
        self.dtype_map = dtype_map or {}  # the compute route's substitutions
        # {main-chain index of an IdCopyNode: the collective it runs instead
        # of copying} (a tensor-parallel rank's sums, tensor_parallel.py)
        self.collectives = collectives or {}
        self.num_constants = graph.numConstantTensors
        self.num_tensors = (
            graph.numConstantTensors + graph.numInputTensors + graph.numOutputTensors
            + graph.numMutableBufferTensors + graph.numTempTensors
        )
        self.num_values = graph.numValues
        self.extra: list = []  # literal and host-shadow slots, after the values
        self._literal_slots: dict[tuple[type, object], int] = {}
        self.input_tids = {
            s.idx for s in (graph.inputMap or []) if s.slotType == md.SlotType.TensorSlot
        }
        self.host_slots: dict[int, int] = {}  # input tid -> frame slot of its host copy
        self.chains: dict[int, list[tuple[str, Run]]] = {}
        self.in_init_chain = False
        self.current_node = "?"
        self._writes: list[tuple[str, object]] = []  # every node built, in order
        self._constants_written: set[int] | None = None  # see fixed_constant
        self._shared_slots: dict = {}
        self._writers: dict[int, list[int]] = {}  # slot -> indices into _writes
        self.presets: dict[int, object] = {}  # slot -> a value every call's frame starts with
        self.host_arrays: dict[int, Callable[[list], mx.array]] = {}  # slot -> made as each call starts
        self._write_counts: dict[int, int] | None = None  # see preset

    # -- slots ------------------------------------------------------------

    @property
    def frame_size(self) -> int:
        return self.num_tensors + self.num_values + len(self.extra)

    def t(self, tid) -> int:
        """Frame index of a required tensor slot (a ``TidT``)."""
        if tid is None:
            raise PteError(f"{self.current_node}: a required tensor slot is missing")
        if not 0 <= tid.idx < self.num_tensors:
            raise PteError(
                f"{self.current_node}: tensor slot {tid.idx} out of range "
                f"(the program has {self.num_tensors} tensor slots)"
            )
        return tid.idx

    def t_opt(self, tid) -> int | None:
        """Frame index of an optional tensor slot, or None when absent."""
        return None if tid is None else self.t(tid)

    def out(self, tid) -> int:
        """Frame index of a tensor slot the node writes."""
        i = self.t(tid)
        if i < self.num_constants and not self.in_init_chain:
            raise PteError(f"{self.current_node}: writes constant tensor slot {i}")
        return i

    def v(self, vid) -> int:
        """Frame index of a scalar value slot (a ``VidT``)."""
        if vid is None:
            raise PteError(f"{self.current_node}: a required value slot is missing")
        if not 0 <= vid.idx < self.num_values:
            raise PteError(
                f"{self.current_node}: value slot {vid.idx} out of range "
                f"(the program has {self.num_values} value slots)"
            )
        return self.num_tensors + vid.idx

    def scratch_slot(self) -> int:
        """A fresh frame slot for a value one op hands to a later one."""
        slot = self.frame_size
        self.extra.append(None)
        return slot

    def fixed_constant(self, i: int) -> mx.array | None:
        """Constant slot ``i``'s array when no chain ever writes it (an init
        chain may fill constants at load), else None."""
        if i >= min(self.num_constants, len(self.constants)) or self.in_init_chain:
            return None
        if self._constants_written is None:
            self._constants_written = {
                slot
                for chain in self.graph.instructionChains or []
                for instr in chain.instructions or []
                for slot in tensor_fields(instr.op)[1]
                if slot < self.num_constants
            }
        return None if i in self._constants_written else self.constants[i]

    def preset(self, slot: int, value) -> bool:
        """Make ``value`` (a node's result, the same in every call) part of the
        frame every call starts from, when no other node of any chain writes
        ``slot``: the node then costs a call nothing and the builder returns
        no run. False where another node writes it (the run must set it)."""
        if self._write_counts is None:
            self._write_counts = {}
            for chain in self.graph.instructionChains or []:
                for instr in chain.instructions or []:
                    for written in tensor_fields(instr.op)[1]:
                        self._write_counts[written] = self._write_counts.get(written, 0) + 1
        if self._write_counts.get(slot, 0) != 1 or slot in self.input_tids:
            return False
        self.presets[slot] = value
        return True

    def shared_scratch_slot(self, key) -> int:
        """One scratch slot per ``key``: ops that build the same per-call
        value (RoPE tables) share it; it starts empty in every call."""
        slot = self._shared_slots.get(key)
        if slot is None:
            slot = self._shared_slots[key] = self.scratch_slot()
        return slot

    def host_array(self, key, make: Callable[[list], mx.array]) -> int:
        """One slot per ``key`` holding ``make(frame)``, an array made from
        the inputs' host copies as each call starts (RoPE at the step's
        position): the ops reading it read no host value themselves, so a
        compiled run (``compiled_runs.py``) can take them."""
        slot = self.shared_scratch_slot(("host array", key))
        self.host_arrays.setdefault(slot, make)
        return slot

    def position_array(self, tid) -> int | None:
        """The slot of a host array of integer tensor ``tid``'s element 0 (a
        step's first position, as RoPE and the cache's kernels take it on a
        GPU), made as each call starts; None where it is not an input's."""
        return self.position_array_of(self._host_source(self.t(tid)))

    def position_array_of(self, i: int) -> int | None:
        """``position_array`` for tensor slot ``i`` (already traced to its source)."""
        if i not in self.input_tids:
            return None
        position = self.host_int_of(i)
        return self.host_array(("position", i), lambda f: mx.array(position(f), dtype=mx.int32))

    def literal(self, value) -> int:
        """Frame index of a slot holding a constant (ints, floats, arrays...)."""
        key = (type(value), value if isinstance(value, (int, float, bool, str)) else id(value))
        slot = self._literal_slots.get(key)
        if slot is None:
            slot = self.frame_size
            self.extra.append(value)
            self._literal_slots[key] = slot
        return slot

    def int_(self, iov) -> int:
        """Frame index of an ``IntOrVid``: its value slot or a literal slot."""
        if iov is None:
            raise PteError(f"{self.current_node}: a required int field is missing")
        return self.v(iov.vid) if iov.isVid else self.literal(clamp_int32(iov.literal))

    def float_(self, fov) -> int:
        """Frame index of a ``FloatOrVid``."""
        if fov is None:
            raise PteError(f"{self.current_node}: a required float field is missing")
        return self.v(fov.vid) if fov.isVid else self.literal(float(fov.literal))

    def static_int(self, iov) -> int | None:
        """The literal of an ``IntOrVid``, or None when it is dynamic."""
        return None if iov.isVid else clamp_int32(iov.literal)

    def ints(self, iovs) -> Callable[[list], list[int]]:
        """A getter for a list of ``IntOrVid`` (constant when all are literal)."""
        iovs = iovs or []
        if all(not x.isVid for x in iovs):
            const = [clamp_int32(x.literal) for x in iovs]
            return lambda f: const
        idx = [self.int_(x) for x in iovs]
        return lambda f: [f[i] for i in idx]

    def dtype(self, scalar_type: int) -> mx.Dtype:
        """The MLX dtype a node computes in, after the compute route."""
        try:
            dtype = mlx_dtype(scalar_type)
        except PteError:
            raise PteError(
                f"{self.current_node}: unsupported dtype {scalar_type_name(scalar_type)}"
            ) from None
        return self.dtype_map.get(dtype, dtype)

    def host_int(self, tid) -> Callable[[list], int]:
        """A getter for element 0 of an integer tensor, read on the host.

        When the tensor is a program input, the caller's host copy is used and
        the device is not touched; otherwise this evaluates the tensor (a sync).
        """
        return self.host_int_of(self._host_source(self.t(tid)))

    def host_int_of(self, i: int) -> Callable[[list], int]:
        """``host_int`` for tensor slot ``i`` (already traced to its source)."""
        if i in self.input_tids:
            slot = self.host_slots.get(i)
            if slot is None:
                slot = self.frame_size
                self.extra.append(None)
                self.host_slots[i] = slot
            return lambda f: f[slot]

        def read(f):
            return int(f[i].reshape(-1)[0].item())

        return read

    @property
    def writes_so_far(self) -> int:
        """How many nodes have been built: the ``step`` of the next one."""
        return len(self._writes)

    def record_write(self, name: str, node) -> None:
        """Remember which node wrote each slot, in order (for ``_host_source``)."""
        self._writes.append((name, node))
        step = len(self._writes) - 1
        out = getattr(node, "out", None)
        written = [out] if hasattr(out, "idx") else []
        for many in ("outs", "outputs"):
            written += getattr(node, many, None) or []
        for t in written:
            self._writers.setdefault(t.idx, []).append(step)

    def writer_before(self, i: int, step: int):
        """The last node that wrote slot ``i`` before write number ``step``."""
        for s in reversed(self._writers.get(i, [])):
            if s < step:
                return s, self._writes[s]
        return None, ("opaque", None)

    def _host_source(self, i: int) -> int:
        """Follow ``i`` back through nodes that keep element [0, ..., 0] in
        place (reshapes, transposes, casts, index-0 takes and slices) to the
        program input it came from; return ``i`` itself when it did not."""
        return self.host_source_at(i, len(self._writes))

    def host_source_at(self, i: int, step: int) -> int:
        """``_host_source`` as of write number ``step``."""
        while i not in self.input_tids:
            step, (name, node) = self.writer_before(i, step)
            if step is None or not _keeps_first_element(name, node):
                return i
            i = node.x.idx
        return i

    def chain(self, index: int) -> Run:
        """A closure running instruction chain ``index`` on the same frame."""
        chains = self.graph.instructionChains
        if not 0 <= index < len(chains):
            raise PteError(f"{self.current_node}: instruction chain {index} out of range")
        if index not in self.chains:
            self.chains[index] = []  # placeholder stops a chain that calls itself
            self.chains[index] = build_chain(self, index)
        ops = self.chains[index]
        return lambda f: run_ops(ops, f)


class Rewrite(NamedTuple):
    """Nodes from one chain position on replaced at load by fewer MLX ops."""

    op: tuple[str, Run]  # replaces the node here and the ``size - 1`` after it
    size: int = 1
    later: dict[int, tuple[str, Run]] = {}  # replacements claimed for later nodes, by instruction index


def _quantized_lookup(ctx, instructions, i, claimed):
    found = plan_quantized_gather(ctx, instructions, i)
    return None if found is None else Rewrite(found, len(GATHER))


def _rotated_attention(ctx, instructions, i, claimed):
    found = plan_rotated_attention(ctx, instructions, i)
    if found is None:
        return None
    j, run = found
    return None if j in claimed else Rewrite(("RopeFused", None), 2 * len(GROUP), later={j: (ROTATED, run)})


def _rope(ctx, instructions, i, claimed):
    found = try_fuse(ctx, instructions, i)
    return None if found is None else Rewrite(found, len(GROUP))


def _head_pair(ctx, instructions, i, claimed):
    found = try_fuse_pair(ctx, instructions, i)
    return None if found is None else Rewrite(found, 2)


def _decode_block(ctx, instructions, i, claimed):
    found = plan_decode_block(ctx, instructions, i, claimed)
    if found is None:
        return None
    first_run, later = found
    return Rewrite(("DecodeBlock", first_run), later={j: ("DecodeBlockPart", run) for j, run in later.items()})


def _swiglu(ctx, instructions, i, claimed):
    found = plan_swiglu(ctx, instructions, i)
    if found is None:
        return None
    silu_run, j, multiply_run = found
    return Rewrite(("SiluNode", silu_run), later={j: ("SwiGLUFused", multiply_run)})


def _residual_add(ctx, instructions, i, claimed):
    found = plan_residual_add(ctx, instructions, i)
    return None if found is None else Rewrite(("ResidualAddFused", found))


def _shared_x_products(ctx, instructions, i, claimed):
    found = plan_group(ctx, instructions, i, claimed)
    if found is None:
        return None
    kind, first_run, later = found
    return Rewrite((f"{kind}Group", first_run), later={j: (f"{kind}Grouped", run) for j, run in later.items()})


# The main chain's load-time rewrites, tried at each node in this order, each
# ``(ctx, instructions, i, claimed) -> Rewrite | None``; the first that
# applies wins. Runs of several nodes come first (an embedding's
# quantized lookup, a layer's q and k RoPE groups its attention applies,
# RoPE's seven nodes, a head split or merge), then
# rewrites of one node that may claim later ones (a GPU's decode blocks,
# SwiGLU's multiply, the products that read the same x); a node an earlier rewrite claimed runs as
# claimed. None changes what the chain computes beyond rounding (fusion.py,
# pairs.py, grouping.py say where).
REWRITES = (_quantized_lookup, _rotated_attention, _rope, _head_pair, _decode_block, _swiglu, _residual_add, _shared_x_products)


def build_chain(ctx: BuildContext, index: int) -> list[tuple[str, Run]]:
    ops = []
    instructions = ctx.graph.instructionChains[index].instructions or []
    claimed: dict[int, tuple[str, Run]] = {}  # instruction index -> its replacement, claimed by an earlier rewrite
    # Rewrites drop intermediates that only later nodes of this chain could
    # read; the init chain and sub-chains share the frame with other chains.
    rewriting = index == ctx.graph.mainChainIdx and not ctx.in_init_chain
    i = 0
    while i < len(instructions):
        instr = instructions[i]
        rewrite = None
        if rewriting and i in ctx.collectives:
            rewrite = Rewrite(("AllSum", _collective(ctx, instr.op, ctx.collectives[i])))
        elif i in claimed:
            rewrite = Rewrite(claimed.pop(i))
        elif rewriting:
            rewrite = _first_rewrite(ctx, instructions, i, claimed)
        if rewrite is not None:
            if rewrite.op[1] is not None:  # None: a claimed node whose work another node of its group does
                ops.append(rewrite.op)
            claimed.update(rewrite.later)
            for done in instructions[i : i + rewrite.size]:
                ctx.record_write(node_name(done), done.op)
            i += rewrite.size
            continue
        i += 1
        name = node_name(instr)
        builder = BUILDERS.get(name)
        if builder is None:
            raise PteError(f"{name} is not supported by this runtime")
        outer, ctx.current_node = ctx.current_node, name
        try:
            run = builder(instr.op, ctx)
            if run is not None:  # None: its result is preset (BuildContext.preset)
                ops.append((name, run))
            ctx.record_write(name, instr.op)
        except (PteError, MemoryError):
            raise
        except Exception as e:  # MLX rejecting a corrupt node's fields at load
            raise PteError(f"{name} (instruction {i - 1}) is invalid: {e}") from None
        finally:
            ctx.current_node = outer
    return ops


def _collective(ctx, copy, collective) -> Run:
    """An ``IdCopyNode`` that runs ``collective`` on what it copies."""
    x, out = ctx.t(copy.x), ctx.out(copy.out)

    def run(f):
        f[out] = collective(f[x])

    return run


def _first_rewrite(ctx, instructions, i, claimed) -> Rewrite | None:
    """The first of ``REWRITES`` that applies at ``i`` without taking over a
    node another rewrite claimed."""
    for plan in REWRITES:
        rewrite = plan(ctx, instructions, i, claimed)
        if rewrite is not None and not claimed.keys() & range(i, i + rewrite.size):
            return rewrite
    return None


_LAYOUT_NODES = {
    "ExpandDimsNode", "ReshapeNode", "SqueezeNode", "AsTypeNode", "IdCopyNode",
    "ContiguousNode", "TransposeNode", "BroadcastToNode",
}


def _keeps_first_element(name: str, node) -> bool:
    if name in _LAYOUT_NODES:
        return True
    if name == "TakeNode":
        return node.index.kind == 0 and node.index.literal == 0
    if name == "SliceNode":
        return not node.start.isVid and node.start.literal == 0 and node.step > 0
    return False


def run_ops(ops: list[tuple[str, Run]], frame: list) -> None:
    for name, run in ops:
        run(frame)


class GraphExecutor:
    """One loaded MLX program: constants, mutable buffers, prepared chains.

    Args:
        graph: the decoded program.
        constants: an array per constant slot, in Tid order.
        cache: the off-graph cache ``UpdateAndAttendNode`` uses, if any.
        dtype_map: dtype substitutions of the compute route (constants must
            already be converted).
        plan: the program's ``Plan``: which route each op takes; by default
            MLX ops and BLAS only.
        layouts: ``{slot: Layout}`` for the quantized weights held in
            another layout than MLX's, with their scales and biases.
        collectives: ``{main-chain index of an IdCopyNode: the collective
            it runs}`` (a tensor-parallel rank's sums).
    """

    def __init__(self, graph: md.MLXGraphT, constants: list[mx.array], cache=None, dtype_map=None,
                 plan=None, layouts=None, collectives=None):
        if len(constants) != graph.numConstantTensors:
            raise PteError(
                f"program has {graph.numConstantTensors} constants, got {len(constants)}"
            )
        self.graph = graph
        ctx = BuildContext(graph, cache, dtype_map, constants, plan, layouts, collectives)
        self._ctx = ctx
        chains = graph.instructionChains
        if not 0 <= graph.mainChainIdx < len(chains):
            raise PteError(f"main chain index {graph.mainChainIdx} out of range")

        self.input_slots = [_slot_index(ctx, s) for s in graph.inputMap or []]
        self.output_slots = [_slot_index(ctx, s) for s in graph.outputMap or []]
        self.input_meta = [_tensor_meta(graph, s) for s in graph.inputMap or []]
        self.output_meta = [_tensor_meta(graph, s) for s in graph.outputMap or []]
        # The dtypes the outputs are declared in (after the compute route):
        # some MLX ops return another (argmax's uint32 for an int64 index).
        # A meta without its (schema-required) shape declares nothing.
        self._output_dtypes = [
            None if m is None or m.shape is None else ctx.dtype(m.scalarType)
            for m in self.output_meta
        ]
        self._mutable = []
        for s in graph.mutableBufferMap or []:
            if s.slotType != md.SlotType.TensorSlot:
                raise PteError("a mutable buffer is not a tensor slot")
            self._mutable.append(ctx.t(_tid(s.idx)))

        init = None
        if graph.initChainIdx >= 0:
            ctx.in_init_chain = True
            init = ctx.chain(graph.initChainIdx)
            ctx.in_init_chain = False
        self._main = build_chain(ctx, graph.mainChainIdx)
        self._main_last_row = self._last_row_variant()
        self.node_names = [name for name, _ in self._main]
        # short steps' chains with their pure runs compiled, by (chain, step shape)
        self._compiled: dict[tuple, CompiledChain] | None = {} if ctx.plan.compiles_steps else None
        self._compiled_rows = ctx.plan.compiled_rows
        # where steps are queued as built (a GPU), a call of several positions
        # built op by op is queued in parts as it is built (_runner)
        steps = ctx.plan.steps
        self._submit_as_built = steps.submit if steps.queue_on_build else None

        template = [None] * ctx.frame_size
        template[: len(constants)] = constants
        for tid in self._mutable:
            meta = _meta_of(graph, tid)
            shape = [d.value for d in meta.shape or []]
            if any(d < 0 for d in shape):
                raise PteError(f"mutable buffer {tid} has a dynamic shape")
            template[tid] = mx.zeros(shape, dtype=ctx.dtype(meta.scalarType))
        template[ctx.num_tensors + ctx.num_values :] = ctx.extra
        for slot, value in ctx.presets.items():
            template[slot] = value
        self._template = template
        self._host_slots = [(i, ctx.host_slots.get(i)) for i in self.input_slots]
        self._host_arrays = list(ctx.host_arrays.items())
        if init is not None:
            run_guarded(init, template, "init chain")
            mx.eval([t for t in template[: ctx.num_constants] if t is not None])

    @property
    def constants(self) -> list[mx.array]:
        return self._template[: self._ctx.num_constants]

    def set_constants(self, arrays: dict[int, mx.array]) -> None:
        """Replace constant slots (a layout only this program's builders read:
        ``layouts`` above)."""
        for tid, array in arrays.items():
            self._template[tid] = array
        if self._compiled:
            self._compiled.clear()  # their traces captured the constants they read

    def _last_row_variant(self) -> list[tuple[str, Run]] | None:
        """The main chain computing its first output for the last position only.

        Offered when the chain ends in the ``AddmmNode`` (or, quantized, the
        ``QuantizedMatmulNode``) that writes that output from rows of
        positions (an LLM's LM head): a matmul's rows are
        independent, so the last row of the product is the product of the
        last row. A caller that reads one position's logits then skips the
        rest: in a 128-token prefill chunk of the 135M Llama, 7 of ~34 GFLOP.
        Only for outputs of 3+ dimensions ([batch, positions, vocab]): a 2-D
        output's rows may be flattened batch and positions.
        """
        instructions = self.graph.instructionChains[self.graph.mainChainIdx].instructions or []
        if not instructions or not self._main or not self.output_slots:
            return None
        last, meta = instructions[-1], self.output_meta[0]
        kind = node_name(last)
        if kind not in ("AddmmNode", "QuantizedMatmulNode") or self._main[-1][0] != kind:
            return None
        if last.op.out.idx != self.output_slots[0] or meta is None or len(meta.shape or []) < 3:
            return None
        if kind == "QuantizedMatmulNode":
            return self._main[:-1] + [(kind, build_quantized_matmul_last_row(last.op, self._ctx))]
        if last.op.bias is not None:
            metas = self.graph.tensorMeta or []
            bias = last.op.bias.idx
            if bias >= len(metas) or metas[bias] is None or len(metas[bias].shape or []) != 1:
                return None
        return self._main[:-1] + [("AddmmNode", build_addmm_last_row(last.op, self._ctx))]

    def execute(self, inputs: list, last_position_only: bool = False) -> list:
        """Run the main chain; tensors come back as lazy ``mx.array``s.

        ``last_position_only``: the caller reads the first output at the last
        position only, so where the program allows (``_last_row_variant``)
        that output is computed, and returned, for that position alone.
        """
        if len(inputs) != len(self.input_slots):
            raise PteError(
                f"the program takes {len(self.input_slots)} inputs, got {len(inputs)}"
            )
        f = self._template.copy()
        rows = 1  # the step's tokens: the most values an input array holds
        for k, ((slot, host_slot), meta, x) in enumerate(
            zip(self._host_slots, self.input_meta, inputs)
        ):
            if meta is None:  # a scalar value slot
                f[slot] = int(x)
                continue
            arr, host = to_mlx(x, meta, k, self._ctx.dtype_map)
            f[slot] = arr
            rows = max(rows, arr.size)
            if host_slot is not None:
                f[host_slot] = int(host.reshape(-1)[0]) if host is not None else int(
                    arr.reshape(-1)[0].item()
                )
        for slot, make in self._host_arrays:
            f[slot] = make(f)
        ops = self._main
        # a one-token step's last row is all of it: the last-row chain
        # whether asked for or not, so every one-token step shares its
        # compiled runs (a token verified on the host and one sampled)
        if (last_position_only or rows == 1) and self._main_last_row is not None:
            ops = self._main_last_row
        run = self._runner(ops, inputs, rows)
        cache = self._ctx.cache
        if cache is None:
            run(f)
        else:
            cache.begin_step()
            try:
                run(f)
            except BaseException:  # Ctrl-C included: no half-written step survives
                cache.abort_step()
                raise
        for tid in self._mutable:
            self._template[tid] = f[tid]
        outs = []
        for slot, dtype in zip(self.output_slots, self._output_dtypes):
            value = f[slot]
            if value is None:
                raise PteError(f"the program never wrote its output slot {slot}")
            if dtype is not None and value.dtype != dtype:
                value = value.astype(dtype)
            outs.append(value)
        return outs


    def _runner(self, ops: list[tuple[str, Run]], inputs: list, rows: int) -> Run:
        """How this step of ``rows`` tokens runs ``ops``: a short step (one
        token; on a GPU up to a verifying call's few, ``Plan.compiled_rows``)
        replays its chain's pure runs compiled (``compiled_runs``) once its
        shape has come twice. The first step of a shape runs op by op (a
        one-off, as a short prompt often is, costs nothing more), the second
        while it is recorded. A call of several positions built op by op
        where steps are queued as they are built (a GPU's: a verifying call,
        a chunk) is handed to the device a few layers at a time as it is
        built."""
        submit = None if rows == 1 else self._submit_as_built
        if self._compiled is None or rows > self._compiled_rows:
            return lambda f: run_checked(ops, f, submit=submit)
        shape = compiled_runs.step_shape(inputs)
        key = (id(ops), shape)
        chain = self._compiled.get(key)
        if chain is not None:
            return chain.run
        if key not in self._compiled:
            self._compiled[key] = None
            return lambda f: run_checked(ops, f, submit=submit)
        kept = set(self.output_slots) | set(self._mutable)

        def record(f):
            self._compiled[key] = CompiledChain.record(ops, f, kept, self._ctx.num_constants, rows)

        return record


def run_guarded(run: Run, frame: list, what: str) -> None:
    try:
        run(frame)
    except PteError:
        raise
    except Exception as e:
        raise PteError(f"{what} failed: {e}") from None


def _tid(idx: int):
    t = md.TidT()
    t.idx = idx
    return t


def _slot_index(ctx: BuildContext, slot) -> int:
    if slot.slotType == md.SlotType.TensorSlot:
        return ctx.t(_tid(slot.idx))
    v = md.VidT()
    v.idx = slot.idx
    return ctx.v(v)


def _meta_of(graph, tid: int):
    metas = graph.tensorMeta or []
    if tid >= len(metas) or metas[tid] is None:
        raise PteError(f"tensor slot {tid} has no metadata")
    return metas[tid]


def _tensor_meta(graph, slot):
    if slot.slotType != md.SlotType.TensorSlot:
        return None
    return _meta_of(graph, slot.idx)


def to_mlx(x, meta, position: int, dtype_map=None):
    """Convert a caller's input to the MLX array the program expects.

    Returns ``(array, host)``, ``host`` being a numpy copy when the input came
    from the host (so a position can be read without a device sync).
    """
    host = None
    if meta.shape is None and isinstance(x, mx.array):
        return x, host  # its meta declares nothing (check_graph): a pipeline stage's residual
    want = mlx_dtype(meta.scalarType)
    want = (dtype_map or {}).get(want, want)
    if isinstance(x, mx.array):
        arr = x
    else:
        if type(x).__module__.startswith("torch"):
            x = x.detach().cpu()
            if str(x.dtype) == "torch.bfloat16":
                x = x.float()
            x = x.numpy()
        host = np.asarray(x)
        if host.dtype == np.float64:
            host = host.astype(np.float32)
        arr = mx.array(host)
    if arr.dtype != want:
        same_kind = mx.issubdtype(arr.dtype, mx.integer) == mx.issubdtype(want, mx.integer)
        if not same_kind:
            raise PteError(
                f"input {position} has dtype {arr.dtype}, the program expects {want}"
            )
        arr = arr.astype(want)
    dims = meta.shape or []
    if arr.ndim != len(dims):
        raise PteError(
            f"input {position} has {arr.ndim} dimensions {tuple(arr.shape)}, "
            f"the program expects {len(dims)}"
        )
    for d, (size, dim) in enumerate(zip(arr.shape, dims)):
        if dim.value >= 0 and size != dim.value:
            raise PteError(
                f"input {position} dimension {d} is {size}, the program expects {dim.value}"
            )
        # Only the upper bound binds: torch.export records a lower bound of 2
        # for dynamic dims (it specializes 0 and 1), yet a 1-token step is valid.
        if dim.value < 0 and dim.maxValue >= 0 and size > dim.maxValue:
            raise PteError(
                f"input {position} dimension {d} is {size}, the program accepts at "
                f"most {dim.maxValue}"
            )
    return arr, host
