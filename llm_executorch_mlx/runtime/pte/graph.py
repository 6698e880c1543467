"""Decoding an MLX delegate payload into its program (an ``MLXGraphT``).

Payload layout (``mlx_graph_serialize.py`` in executorch): a 24-byte header
(4 zero bytes, ``MLX0``, u64 data-segment offset, u64 data-segment size), then
the ``MLXGraph`` flatbuffer of ``schema.fbs``. Decoding happens once, at load.
"""

from __future__ import annotations

import struct

from ..errors import PteError
from ._schema import mlx_delegate as md
from ._schema.mlx_required import REQUIRED
from .container import flatbuffer_fault

HEADER_LENGTH = 24
MAGIC = b"MLX0"
MAX_RANK = 64  # numpy's and MLX's practical limit; more is a corrupt file

# Union tag -> node class name ("AddNode", ...), from the installed schema.
NODE_NAMES: dict[int, str] = {
    value: name
    for name, value in vars(md.OpNode).items()
    if not name.startswith("_") and isinstance(value, int) and value != md.OpNode.NONE
}


def decode_graph(payload) -> md.MLXGraphT:
    """Decode an MLX delegate payload; raise ``PteError`` when it is not one."""
    data = bytes(payload)
    if len(data) < HEADER_LENGTH + 8:
        raise PteError(f"MLX payload too short ({len(data)} bytes)")
    if data[4:8] != MAGIC:
        raise PteError(
            f"MLX payload has magic {data[4:8]!r}, expected {MAGIC!r}: not an MLX "
            "delegate program, or written by an incompatible executorch"
        )
    seg_offset, seg_size = struct.unpack_from("<QQ", data, 8)
    if seg_offset > len(data) or seg_offset + seg_size > len(data):
        raise PteError("MLX payload header points past the end of the payload")
    try:
        root = md.MLXGraph.GetRootAs(data, HEADER_LENGTH)
        graph = md.MLXGraphT.InitFromObj(root)
    except Exception as e:
        raise PteError(f"corrupt MLX program flatbuffer: {flatbuffer_fault(e)}") from None
    check_graph(graph, len(data))
    return graph


_SLOT_TYPES = {v for k, v in vars(md.SlotType).items() if not k.startswith("_")}


def check_graph(graph: md.MLXGraphT, payload_size: int) -> None:
    """Check what later steps trust, once, at load: required fields present,
    union members of their declared type, strings UTF-8 (made ``str``), every
    slot index in range, chain indices valid, and slot counts no larger than
    the payload could describe (a frame holds one entry per slot). Raise
    ``PteError`` naming the table and field."""
    if not graph.instructionChains:
        raise PteError("MLX program has no instruction chains")
    n_tensors = (
        graph.numConstantTensors + graph.numInputTensors + graph.numOutputTensors
        + graph.numMutableBufferTensors + graph.numTempTensors
    )
    if n_tensors + graph.numValues > payload_size:
        raise PteError(
            f"MLX program declares {n_tensors} tensor and {graph.numValues} value slots, "
            f"more than its {payload_size} bytes can describe: corrupt file"
        )
    chains = len(graph.instructionChains)
    if graph.mainChainIdx >= chains or not (graph.initChainIdx == -1 or 0 <= graph.initChainIdx < chains):
        raise PteError(
            f"MLX program's main chain {graph.mainChainIdx} or init chain {graph.initChainIdx} "
            f"is not one of its {chains} chains"
        )
    if len(graph.tensorMeta or []) > n_tensors:
        raise PteError(f"MLX program has {len(graph.tensorMeta)} tensor metadata entries for {n_tensors} tensors")
    _check_table(graph, "graph", n_tensors, graph.numValues)


def _check_table(obj, path: str, n_tensors: int, n_values: int, node: str = "MLX program") -> None:
    """Check one table and those below it; messages start with the node that
    holds the fault (or "MLX program") and end with its path in the graph."""
    kind = type(obj).__name__
    at = f" (at {path})"
    if kind == "TidT":
        if not 0 <= obj.idx < n_tensors:
            raise PteError(f"{node}: tensor slot {obj.idx} out of range (the program has {n_tensors}){at}")
        return
    if kind == "VidT":
        if not 0 <= obj.idx < n_values:
            raise PteError(f"{node}: value slot {obj.idx} out of range (the program has {n_values}){at}")
        return
    if kind == "SlotVariantT":
        if obj.slotType not in _SLOT_TYPES:
            raise PteError(f"{node}: unknown slot type {obj.slotType}{at}")
        bound = n_tensors if obj.slotType == md.SlotType.TensorSlot else n_values
        if not 0 <= obj.idx < bound:
            raise PteError(f"{node}: slot {obj.idx} out of range (the program has {bound}){at}")
        return
    if kind == "TensorMetaT" and obj.shape is not None:
        if len(obj.shape) > MAX_RANK:
            raise PteError(f"{node}: rank {len(obj.shape)} is more than any tensor has ({MAX_RANK}){at}")
        if any(d is not None and d.value < -1 for d in obj.shape):
            raise PteError(f"{node}: negative dimension in shape {[d.value for d in obj.shape if d]}{at}")
    if kind == "InstructionT":
        name = NODE_NAMES.get(obj.opType)
        if name is None or type(obj.op).__name__ != name + "T":
            raise PteError(f"{node}: unknown or malformed node (type {obj.opType}){at}")
        node = name
    for field in REQUIRED.get(kind, ()):
        # A tensor's metadata may leave out its shape, though the schema marks
        # it required: it then declares nothing (no reader takes a shape or a
        # dtype from it, the interpreter casts only declared outputs).
        if getattr(obj, field) is None and (kind, field) != ("TensorMetaT", "shape"):
            raise PteError(f"{node}: {field} is missing{at}")
    for field, value in vars(obj).items():
        if isinstance(value, bytes):
            try:
                setattr(obj, field, value.decode())
            except UnicodeDecodeError:
                raise PteError(f"{node}: {field} is not UTF-8 text{at}") from None
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if item is None:
                    raise PteError(f"{node}: entry {i} of {field} is missing{at}")
                if hasattr(item, "__dict__"):
                    _check_table(item, f"{path}.{field}[{i}]", n_tensors, n_values, node)
        elif hasattr(value, "__dict__"):
            _check_table(value, f"{path}.{field}", n_tensors, n_values, node)


def encode_graph(graph: md.MLXGraphT) -> bytes:
    """Serialize a graph into a payload ``decode_graph`` reads (tests build graphs)."""
    import flatbuffers

    builder = flatbuffers.Builder(1024)
    builder.Finish(graph.Pack(builder))
    body = bytes(builder.Output())
    header = b"\0\0\0\0" + MAGIC + struct.pack("<QQ", HEADER_LENGTH + len(body), 0)
    return header + body


def node_name(instr: md.InstructionT) -> str:
    return NODE_NAMES.get(instr.opType, f"unknown node type {instr.opType}")


def tensor_fields(op) -> tuple[set[int], set[int]]:
    """The tensor slots a node reads and the ones it writes."""
    reads, writes = set(), set()
    for field, value in vars(op).items():
        items = value if isinstance(value, list) else [value]
        tids = {v.idx for v in items if type(v).__name__ == "TidT"}
        (writes if field in ("out", "outs", "outputs") else reads).update(tids)
    return reads, writes
