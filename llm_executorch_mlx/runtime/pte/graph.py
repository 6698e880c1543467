"""Decoding an MLX delegate payload into its program (an ``MLXGraphT``).

Payload layout (``mlx_graph_serialize.py`` in executorch): a 24-byte header
(4 zero bytes, ``MLX0``, u64 data-segment offset, u64 data-segment size), then
the ``MLXGraph`` flatbuffer of ``schema.fbs``. Decoding happens once, at load.
"""

from __future__ import annotations

import struct

from ..errors import PteError
from ._schema import mlx_delegate as md

HEADER_LENGTH = 24
MAGIC = b"MLX0"

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
        raise PteError(f"corrupt MLX program flatbuffer ({type(e).__name__}: {e})") from None
    if not graph.instructionChains:
        raise PteError("MLX program has no instruction chains")
    return graph


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
