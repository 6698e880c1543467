"""Pipeline parallel: one rank of a forward program split over an ``mx.distributed`` group.

Rank r runs layers ``[first, end)`` (``cut.py``): rank 0 from the token
embedding, the last rank through the LM head. The residual stream goes
from rank r to r + 1 with ``send``/``recv`` (ring neighbours), and the last
rank's logits reach every rank through one ``all_sum`` (the other ranks add
zeros, which is exact), so every rank samples the same token from the same
logits and runs the same text pipeline: its cache answers for the model's
every layer (length, rewind, floors, step limits) while it holds the pools
of its own layers only.

    group = mx.distributed.init(backend="ring", strict=True)
    rank = Pipeline(load_program("model.pte"), group)
    cache = rank.new_cache(capacity=1024)
    forward = rank.load_method("forward", cache=cache)
    logits = forward.execute([input_ids, cache_position])[0]  # the same on every rank

Collectives run in the same order on every rank: a rank's share of the
logits depends on its send, so no rank enters the ``all_sum`` of a call
before it has sent that call's residual.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .cut import Stage, plan_stages, stage_graph
from .dtypes import mlx_dtype
from .errors import PteError

# The residual's dtype, as a number the handshake sends.
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_HEADER = 8  # int32s: dtype code, trailing rank, trailing dims


class Pipeline:
    """Rank ``group.rank()``'s share of ``program``, ``layers[r]`` layers to
    rank ``r`` (default: as even as can be). Reads as the program does
    (``metadata``, ``compute_dtype``...); its caches and methods are the rank's."""

    def __init__(self, program, group, layers: list[int] | None = None):
        self.program = program
        self.group = group
        self.stage = plan_stages(program.graph("forward"), group.size(), layers)[group.rank()]
        # The residual's (dims after the tokens', dtype) arriving and leaving,
        # once the first call told them (a header before its data).
        self._arriving = self._leaving = None

    def __getattr__(self, name):
        return getattr(self.program, name)

    def __repr__(self) -> str:
        return f"Pipeline(rank {self.group.rank()} of {self.group.size()}: layers {self.stage.first}-{self.stage.end - 1})"

    def new_cache(self, *args, **kwargs):
        """``Program.new_cache``, with pools for this rank's layers only."""
        return self.program.new_cache(*args, held=range(self.stage.first, self.stage.end), **kwargs)

    def load_method(self, name: str, cache=None):
        if name != "forward":
            return self.program.load_method(name, cache)
        return self.program.load_method(name, cache, stage=_Share(self))


class _Share:
    """What ``Program.load_method`` asks of a stage: its graph and the
    constants it holds, and the communication around its executor."""

    tensor_ranks = 1  # its layers' heads are whole
    collectives: dict = {}  # none inside its graph

    def __init__(self, rank: Pipeline):
        self.rank = rank
        self.stage: Stage = rank.stage

    def __str__(self) -> str:
        return f"layers {self.stage.first}-{self.stage.end - 1}"

    def graph(self, graph):
        graph, constants = stage_graph(graph, self.stage)
        return graph, dict.fromkeys(constants, ())

    def wrap(self, execute, call, dtype_map):
        """``execute`` (the stage's executor) as the whole forward's delegate
        run: its inputs in, the logits out, on every rank."""
        rank, stage, group = self.rank, self.stage, self.rank.group
        r, size = group.rank(), group.size()
        tokens_at = call.inputs.index(("input", 0))  # the forward's first input: the token ids
        logits_shape, logits_dtype = _logits_meta(rank.program.graph("forward"), dtype_map)

        def run(inputs: list, last_position_only: bool) -> list:
            ids = inputs[tokens_at]
            tokens = tuple(ids.shape) if hasattr(ids, "shape") else np.shape(ids)  # a device array stays lazy
            if not stage.is_first:
                if rank._arriving is None:
                    rank._arriving = _receive_header(r - 1, group)
                dims, dtype = rank._arriving
                inputs = list(inputs) + [mx.distributed.recv(tokens + dims, dtype, r - 1, group=group)]
            out = execute(inputs, last_position_only)[0]
            rows = logits_shape[1] if logits_shape[1] >= 0 else (1 if last_position_only else tokens[-1])
            if stage.is_last:
                share = out[:, -rows:] if out.shape[1] != rows else out
                if share.shape != (tokens[0], rows, logits_shape[2]):
                    raise PteError(f"the forward's logits have shape {tuple(share.shape)}, not [batch, positions, vocab]: "
                                   "it cannot be split between ranks")
            else:
                if out.shape[: len(tokens)] != tokens:
                    raise PteError(f"the residual stream leaving layer {stage.end - 1} has shape {tuple(out.shape)}, "
                                   f"not the token ids' {tokens} and more: the forward cannot be split there")
                if rank._leaving is None:
                    rank._leaving = (tuple(out.shape[len(tokens):]), out.dtype)
                    _send_header(rank._leaving, r + 1, group)
                elif rank._leaving != (tuple(out.shape[len(tokens):]), out.dtype):
                    raise PteError(f"the residual stream changed shape or dtype ({tuple(out.shape)} {out.dtype})")
                sent = mx.distributed.send(out, r + 1, group=group)
                mx.async_eval(sent)  # runs whether or not this rank reads the logits
                share = mx.depends(mx.zeros((tokens[0], rows, logits_shape[2]), logits_dtype), sent)
            return [mx.distributed.all_sum(share, group=group)] if size > 1 else [share]

        return run


def _logits_meta(graph, dtype_map) -> tuple[tuple[int, ...], mx.Dtype]:
    """The forward's logits' declared ``[batch, positions, vocab]`` (-1 where
    dynamic) and dtype after the compute route: what a rank without the LM
    head adds zeros of."""
    outputs = graph.outputMap or []
    metas = graph.tensorMeta or []
    meta = metas[outputs[0].idx] if len(outputs) == 1 and outputs[0].idx < len(metas) else None
    shape = [d.value for d in meta.shape or []] if meta is not None else []
    if len(shape) != 3 or shape[2] < 0:
        raise PteError("the forward does not return one [batch, positions, vocab] tensor of logits: "
                       "it cannot be split between ranks")
    dtype = mlx_dtype(meta.scalarType)
    return tuple(shape), dtype_map.get(dtype, dtype)


def _send_header(trailing: tuple[tuple[int, ...], mx.Dtype], dst: int, group) -> None:
    dims, dtype = trailing
    if len(dims) > _HEADER - 2 or dtype not in _DTYPES:
        raise PteError(f"the residual stream is {dims} {dtype}: it cannot cross ranks")
    header = np.zeros(_HEADER, np.int32)
    header[:2] = _DTYPES.index(dtype), len(dims)
    header[2 : 2 + len(dims)] = dims
    mx.eval(mx.distributed.send(mx.array(header), dst, group=group))


def _receive_header(src: int, group) -> tuple[tuple[int, ...], mx.Dtype]:
    header = mx.distributed.recv((_HEADER,), mx.int32, src, group=group).tolist()
    return tuple(header[2 : 2 + header[1]]), _DTYPES[header[0]]
