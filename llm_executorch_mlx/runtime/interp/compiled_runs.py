"""A short step's runs of pure ops, replayed through ``mx.compile``.

Building a step's lazy graph costs the host a few microseconds an op in
Python (the closures, MLX's bindings), and a decode step of a small model
is hundreds of ops (617 for the 135M Llama): about a third of its step on
two CPU cores, and on a GPU about half. Most of those ops are pure
functions of the frame: between the ops that act beyond the frame (the
off-graph cache's write and attention, a collective) they read arrays and
fixed values and write arrays; what an op needs from the host (RoPE's
position) is made into an array as the call starts (``host_array``).
``mx.compile`` traces such a run once and replays its graph from C++ at
about a third of the host's cost an op; MLX may also fuse its elementwise
ops.

A step's chain is split at the second call of a step shape (the inputs'
shapes and dtypes; a shape that comes once costs nothing) by recording
which slots each op reads and writes. A run of pure ops becomes one
compiled call: its inputs are the arrays it reads that earlier ops (or the
step's inputs) wrote, the constants are captured, its outputs are the
slots later ops or the step's outputs read. Whatever else it reads from the
frame (shape sizes, literals) is checked at each replay against what its
trace read, so a replay never sees other values than its trace did: an op
found reading a value that changes (a position on the host) is built op by
op from then on and the runs around it re-planned, and a run that cannot
be traced (an op that reads a value on the host) is built op by op. Only
short steps are compiled (``Plan.compiled_rows``): decode steps, and on a
GPU a speculative try's verifying calls, whose build op by op is most of
such a call there; a prefill chunk is bound by its arithmetic, and each
new chunk length would cost a recording and traces.

An op beyond the frame joins a run where it has a prelude (``run.prelude``,
``run.traced``): a GPU's cache kernel, which writes the pools in place and
reads the position from an array. Its prelude does the host's part at every
call, before the run (the cache's bookkeeping for the step's tokens), and
returns the arrays its traced part captures (the pools'); a run is traced
again where those changed (a pool grown or replaced). Its reads are the
host's, not the run's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import NeedsHost, PteError
from .ops.attention import ROTATED

# they act beyond the frame: the cache (its attention, with or without its
# RoPE: ops/attention.py), a collective
HOST_OPS = frozenset({"UpdateAndAttendNode", ROTATED, "AllSum"})
# a call built op by op on a GPU hands the device what it has built so far
# after this many layers' attention (``run_checked``'s ``submit``): the
# device then computes those layers while the host builds the rest
SUBMIT_EVERY = 4


class _NeedsHost(Exception):
    """An op with a prelude, by index, cannot be traced at this step."""

    def __init__(self, op: int):
        super().__init__(op)
        self.op = op


class _Varies(Exception):
    """A run read other fixed values than its trace did, in these slots."""

    def __init__(self, slots: set[int]):
        super().__init__(slots)
        self.slots = slots


def step_shape(inputs: list) -> tuple:
    """The key a step's compiled runs are kept under: its inputs' shapes and
    dtypes (a host value's type)."""
    key = []
    for x in inputs:
        if isinstance(x, (list, tuple)):  # as ``to_mlx`` takes it
            x = np.asarray(x)
        shape = getattr(x, "shape", None)
        if shape is None:
            key.append(type(x))
            continue
        # the dtype's name alone: a numpy input becomes an MLX array of the
        # same name, so a step fed from the host shares the compiled runs of
        # one fed with arrays ("uint32", not "mlx.core.uint32")
        key.append((tuple(shape), str(x.dtype).rsplit(".", 1)[-1]))
    return tuple(key)


class _Recording(list):
    """A frame that logs each slot read and written, and by which op."""

    def __init__(self, frame: list):
        super().__init__(frame)
        self.op = -1
        self.log: list[tuple[int, bool, int]] = []  # (op, written, slot)

    def __getitem__(self, slot):
        if self.op is not None:  # None: a prelude's read, the host's
            self.log.append((self.op, False, slot))
        return list.__getitem__(self, slot)

    def __setitem__(self, slot, value):
        self.log.append((self.op, True, slot))
        list.__setitem__(self, slot, value)


@dataclass
class _Run:
    """Ops ``first``..``last`` of a chain as one compiled call."""

    first: int
    last: int
    reads: list[int]  # slots it reads before writing them, constants aside
    captured: list[int]  # the constants it reads: part of its trace
    outputs: list[int]  # slots it writes that are read after it
    preludes: list[int]  # its ops with a prelude
    key: tuple | None = None  # what it read at its trace: the array slots' shapes, the other slots' values
    trace: tuple | None = None  # (compiled, array output slots, host outputs)
    captured_arrays: tuple = ()  # the arrays its preludes gave the trace
    off: bool = False  # built op by op from now on

    def call(self, ops: list, frame: list, rows: int) -> None:
        """Replay the run, in a step of ``rows`` tokens (its first call
        traces it, as does a call whose preludes give other arrays);
        ``_Varies`` where it reads other fixed values than its trace did;
        ``_NeedsHost`` where an op with a prelude cannot be traced at this
        step (nothing but the preludes run then)."""
        reserved = {i: ops[i][1].prelude(frame, rows) for i in self.preludes}
        given = tuple(a for arrays in reserved.values() for a in arrays)
        if self.trace is not None and (len(given) != len(self.captured_arrays)
                                       or any(a is not b for a, b in zip(given, self.captured_arrays))):
            self.trace = None  # its captured pools are not the cache's any more
        arrays, key = [], []
        for slot in self.reads:
            value = frame[slot]
            if isinstance(value, mx.array):
                arrays.append(slot)
                key.append((slot, value.shape, value.dtype))
            else:
                key.append((slot, type(value), _fixed(value)))
        key = tuple(key)
        if self.trace is None:
            self.key, self.captured_arrays = key, given
            self.trace = self._trace(ops, frame, arrays, reserved, rows)
            if self.trace is None:  # an op that cannot be traced
                self.off = True
                self.run_ops(ops, frame)
            return
        if key != self.key:
            raise _Varies({k[0] for k, seen in zip(key, self.key) if k != seen})
        compiled, array_outputs, host_outputs = self.trace
        for slot, value in zip(array_outputs, compiled(*[frame[s] for s in arrays])):
            frame[slot] = value
        for slot, value in host_outputs:
            frame[slot] = value

    def _trace(self, ops: list, frame: list, arrays: list[int], reserved: dict, rows: int):
        """Trace the run on this call's inputs and write its outputs:
        ``(compiled, array output slots, host outputs)``, or None where the
        run cannot be traced (nothing written then); ``_NeedsHost`` where
        an op with a prelude cannot take this step from a trace."""
        base = [None] * len(frame)  # what the run reads, and nothing else of this step
        for slot in self.captured + self.reads:
            base[slot] = frame[slot]
        written: list = []  # the frame the trace ended with

        def replay(*xs):
            f = list(base)
            for slot, x in zip(arrays, xs):
                f[slot] = x
            for i in range(self.first, self.last + 1):
                run = ops[i][1]
                if i not in reserved:
                    run(f)
                    continue
                try:
                    run.traced(f, reserved[i], rows)
                except NeedsHost:
                    raise _NeedsHost(i) from None
            written[:] = [f]
            return [f[s] for s in self.outputs if isinstance(f[s], mx.array)]

        compiled = mx.compile(replay)
        try:
            outs = compiled(*[frame[s] for s in arrays])
        except _NeedsHost:
            raise
        except Exception:  # an op that needs a value on the host: build it op by op
            return None
        if not written:  # MLX answered from a trace it holds under this function's id: not ours
            return None
        f = written[0]
        array_outputs = [s for s in self.outputs if isinstance(f[s], mx.array)]
        host_outputs = [(s, f[s]) for s in self.outputs if not isinstance(f[s], mx.array)]
        for slot, value in zip(array_outputs, outs):
            frame[slot] = value
        for slot, value in host_outputs:
            frame[slot] = value
        return compiled, array_outputs, host_outputs

    def run_ops(self, ops: list, frame: list) -> None:
        run_checked(ops, frame, self.first, self.last + 1)


class CompiledChain:
    """One chain at one step shape: its pure runs compiled, the rest op by op.

    Made by ``record``, which runs the chain once (op by op) and learns from
    the reads and writes which runs to compile. An op found reading a fixed
    value that changes from step to step (a position, on the host) is built
    op by op from then on, the runs re-planned around it."""

    def __init__(self, ops: list, log: list[tuple[int, bool, int]], kept: set[int], constants: int, rows: int):
        self.ops, self._log, self._kept, self._constants, self.rows = ops, log, kept, constants, rows
        self._host_ops: set[int] = set()  # ops read values that change
        self.runs = {r.first: r for r in _plan_runs(ops, log, kept, constants, self._host_ops)}

    @classmethod
    def record(cls, ops: list, frame: list, kept: set[int], constants: int, rows: int) -> "CompiledChain":
        """Run ``ops`` on ``frame`` (a step of ``rows`` tokens) as
        ``run_checked`` does, and plan the compiled runs. ``kept``: slots
        read after the chain (its outputs, mutable buffers); ``constants``:
        slots below it are the program's constants, captured rather than
        passed."""
        recording = _Recording(frame)
        for i in range(len(ops)):
            recording.op = i
            _record_op(ops, recording, i, rows)
        frame[:] = recording
        return cls(ops, recording.log, kept, constants, rows)

    def run(self, frame: list) -> None:
        ops = self.ops
        i, n = 0, len(ops)
        while i < n:
            r = self.runs.get(i)
            if r is None or r.off:
                run_checked(ops, frame, i, i + 1)
                i += 1
                continue
            try:
                r.call(ops, frame, self.rows)
            except _Varies as v:
                self._build_apart(r, v.slots)
                continue  # from op i again, as re-planned
            except _NeedsHost as e:
                self._build_apart_ops(r, {e.op})
                continue  # its preludes' bookkeeping bears repeating
            except (PteError, MemoryError):
                raise
            except Exception as e:
                raise PteError(f"{ops[r.first][0]} (instructions {r.first}-{r.last}) failed: {e}") from None
            i = r.last + 1

    def _build_apart(self, run: _Run, slots: set[int]) -> None:
        """Take the ops of ``run`` that read ``slots`` out of the compiled runs."""
        readers = {op for op, wrote, slot in self._log
                   if run.first <= op <= run.last and not wrote and slot in slots}
        self._build_apart_ops(run, readers or set(range(run.first, run.last + 1)))

    def _build_apart_ops(self, run: _Run, host_ops: set[int]) -> None:
        """Take ``host_ops`` (of ``run``) out of the compiled runs."""
        self._host_ops |= host_ops
        kept = {r.first: r for r in self.runs.values() if r.last < run.first or r.first > run.last}
        fresh = _plan_runs(self.ops, self._log, self._kept, self._constants, self._host_ops)
        kept.update({r.first: r for r in fresh if run.first <= r.first and r.last <= run.last})
        self.runs = kept


def _plan_runs(ops: list, log: list[tuple[int, bool, int]], kept: set[int], constants: int,
               host_ops: set[int]) -> list[_Run]:
    """The runs of two or more pure ops (none of ``host_ops``, by index),
    with the slots each reads and the ones read after it."""
    spans, start = [], None
    for i, (name, run) in enumerate(ops + [("", None)]):
        pure = i < len(ops) and (name not in HOST_OPS or hasattr(run, "prelude")) and i not in host_ops
        if pure and start is None:
            start = i
        elif not pure and start is not None:
            if i - start > 1:
                spans.append((start, i - 1))
            start = None
    by_slot: dict[int, list[tuple[int, bool]]] = {}
    for op, wrote, slot in log:
        by_slot.setdefault(slot, []).append((op, wrote))
    order = [op for op, _, _ in log]  # the log is in op order: ops ran one after another
    runs = []
    for first, last in spans:
        reads, captured, writes, seen = [], [], set(), set()
        for op, wrote, slot in log[bisect.bisect_left(order, first):bisect.bisect_right(order, last)]:
            if wrote:
                writes.add(slot)
            elif slot not in writes and slot not in seen:
                seen.add(slot)
                (reads if slot >= constants else captured).append(slot)
        outputs = sorted(s for s in writes if _read_after(by_slot[s], last, s in kept))
        preludes = [i for i in range(first, last + 1) if hasattr(ops[i][1], "prelude")]
        runs.append(_Run(first, last, reads, captured, outputs, preludes))
    return runs


def _fixed(value):
    """What a fixed value read is compared by: itself where it is plain
    (numbers, strings, dtypes, tuples of them), else its identity."""
    plain = (int, float, bool, str, type(None), mx.Dtype)
    if isinstance(value, plain):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, plain) for v in value):
        return tuple(value)
    return id(value)


def _read_after(events: list[tuple[int, bool]], last: int, kept: bool) -> bool:
    """Whether the value a slot holds after op ``last`` is read: by a later
    op before another write, or after the chain (``kept``)."""
    for op, wrote in events:
        if op > last:
            return not wrote
    return kept


def _record_op(ops: list, recording: _Recording, i: int, rows: int) -> None:
    """Run op ``i`` on ``recording`` as ``run_checked`` does, logging only
    what a trace of it would read: an op with a prelude runs its prelude
    unlogged, then its traced part (or, where that needs the host, the op)."""
    run = ops[i][1]
    if not hasattr(run, "prelude"):
        run_checked(ops, recording, i, i + 1)
        return
    recording.op = None
    try:
        reserved = run.prelude(recording, rows)
        recording.op = i
        run.traced(recording, reserved, rows)
    except NeedsHost:
        recording.op = i
        run_checked(ops, recording, i, i + 1)  # the prelude's bookkeeping bears repeating
    except (PteError, MemoryError):
        raise
    except Exception as e:
        raise PteError(f"{ops[i][0]} (instruction {i}) failed: {e}") from None


def run_checked(ops: list, frame: list, start: int = 0, stop: int | None = None, submit=None) -> None:
    """Run ``ops[start:stop]``, turning any failure into a ``PteError`` naming
    the node; with ``submit``, hand it the output of every
    ``SUBMIT_EVERY``-th op that names it (``run.writes``: a layer's cache
    write and attention)."""
    named = 0  # ops passed that name their output
    for i in range(start, len(ops) if stop is None else stop):
        name, run = ops[i]
        try:
            run(frame)
        except (PteError, MemoryError):
            raise
        except Exception as e:
            raise PteError(f"{name} (instruction {i}) failed: {e}") from None
        writes = None if submit is None else getattr(run, "writes", None)
        if writes is not None:
            named += 1
            if named % SUBMIT_EVERY == 0:
                submit(frame[writes])

