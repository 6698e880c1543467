"""The .pte container: program flatbuffer, segments, named data, plans.

The file is memory-mapped once; segments, named data and delegate payloads
are handed out as zero-copy memoryviews into that map. Only
``executorch_program`` (a flatc reader of the installed executorch's
``program.fbs``) is used to read it, so nothing here imports torch.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import PteError
from ._schema import executorch_program as ep

_EXTENDED_HEADER_MAGIC = b"eh"
_EXTENDED_HEADER_OFFSET = 8
_EXTENDED_HEADER_MIN_SIZE = 24


@dataclass(frozen=True)
class TensorValue:
    """A tensor EValue: its dtype, (upper-bound) sizes and constant data index."""

    scalar_type: int
    sizes: tuple[int, ...]
    data_buffer_idx: int
    dynamic: bool


@dataclass(frozen=True)
class DelegateInfo:
    backend_id: str
    payload: bytes  # the delegate's program (weights live in named data)
    compile_specs: dict[str, bytes]


@dataclass(frozen=True)
class Plan:
    """One method (ExecutionPlan): its values and how it runs."""

    name: str
    values: list  # decoded EValues: int, float, bool, str, None, list, TensorValue
    inputs: list[int]
    outputs: list[int]
    delegates: list[DelegateInfo]
    delegate_args: list[list[int]]  # per DelegateCall, in chain order
    kernel_calls: int  # non-delegated operator calls (we cannot run them)


class PteFile:
    """A memory-mapped .pte file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise PteError(f"{self.path}: the file is empty, not a .pte program")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise PteError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise PteError(f"{self.path}: is a directory, not a .pte file") from None
        except PermissionError:
            raise PteError(f"{self.path}: permission denied") from None
        self.size = size
        self.buffer = memoryview(self._map)
        try:
            self._read_header()
            self._read_program()
        except PteError as e:
            if str(e).startswith(self.path):
                raise
            raise PteError(f"{self.path}: {e}") from None
        except Exception as e:  # the flatbuffer reader raises anything on garbage
            raise PteError(f"{self.path}: corrupt or truncated .pte program: {flatbuffer_fault(e)}") from None

    def _read_header(self) -> None:
        if self.size < 8 or bytes(self.buffer[4:6]) != b"ET":
            raise PteError(
                f"{self.path}: not an ExecuTorch .pte file (no 'ET' file identifier)"
            )
        self.segment_base = 0
        self.program_size = self.size
        if self.size >= _EXTENDED_HEADER_OFFSET + _EXTENDED_HEADER_MIN_SIZE and bytes(
            self.buffer[8:10]
        ) == _EXTENDED_HEADER_MAGIC:
            header_len, program_size, segment_base = struct.unpack_from(
                "<IQQ", self.buffer, 12
            )
            if header_len < _EXTENDED_HEADER_MIN_SIZE or program_size > self.size:
                raise PteError(f"{self.path}: corrupt extended header")
            self.program_size = program_size
            self.segment_base = segment_base

    def _read_program(self) -> None:
        program = ep.Program.GetRootAs(self._map, 0)
        self._program = program
        self._segments = []
        for i in range(program.SegmentsLength()):
            seg = program.Segments(i)
            start = self.segment_base + seg.Offset()
            end = start + seg.Size()
            if end > self.size:
                raise PteError(
                    f"{self.path}: truncated file: segment {i} ends at byte {end}, "
                    f"the file has {self.size}"
                )
            self._segments.append((start, end))
        self._named = {}
        for i in range(program.NamedDataLength()):
            nd = program.NamedData(i)
            self._named[_text(nd.Key(), f"named data {i}'s key")] = nd.SegmentIndex()
        self.plans = {}
        for i in range(program.ExecutionPlanLength()):
            plan = self._read_plan(program.ExecutionPlan(i))
            self.plans[plan.name] = plan

    # -- data ---------------------------------------------------------------

    def segment(self, index: int) -> memoryview:
        if not 0 <= index < len(self._segments):
            raise PteError(f"{self.path}: segment index {index} out of range")
        start, end = self._segments[index]
        return self.buffer[start:end]

    def named_data(self, key: str) -> memoryview:
        try:
            index = self._named[key]
        except KeyError:
            raise PteError(
                f"{self.path}: named data '{key}' is missing (weights stored in an "
                "external .ptd file are not supported)"
            ) from None
        return self.segment(index)

    def named_data_span(self, key: str) -> tuple[int, int]:
        """Where named data ``key`` lies in the file: ``(start, end)`` byte offsets."""
        self.named_data(key)  # the one error for a missing key
        return self._segments[self._named[key]]

    @property
    def named_data_keys(self) -> list[str]:
        return list(self._named)

    def constant_data(self, data_buffer_idx: int, nbytes: int) -> memoryview:
        """Bytes of a constant tensor stored by the program itself."""
        try:
            return self._constant_data(data_buffer_idx, nbytes)
        except PteError:
            raise
        except Exception as e:  # the flatbuffer reader raises anything on garbage
            raise PteError(
                f"{self.path}: constant {data_buffer_idx}: corrupt constant table: {flatbuffer_fault(e)}"
            ) from None

    def _constant_data(self, data_buffer_idx: int, nbytes: int) -> memoryview:
        program = self._program
        cs = program.ConstantSegment()
        if cs is not None and cs.OffsetsLength() > 0:
            if data_buffer_idx >= cs.OffsetsLength():
                raise PteError(f"{self.path}: constant {data_buffer_idx} out of range")
            seg = self.segment(cs.SegmentIndex())
            start = cs.Offsets(data_buffer_idx)
            if start + nbytes > len(seg):
                raise PteError(f"{self.path}: constant {data_buffer_idx} out of range")
            return seg[start : start + nbytes]
        if data_buffer_idx >= program.ConstantBufferLength():
            raise PteError(f"{self.path}: constant {data_buffer_idx} out of range")
        storage = program.ConstantBuffer(data_buffer_idx).StorageAsNumpy()
        if not isinstance(storage, np.ndarray) or storage.nbytes < nbytes:
            raise PteError(f"{self.path}: constant {data_buffer_idx} holds fewer than its {nbytes} bytes")
        return memoryview(storage.tobytes()[:nbytes])

    # -- plans --------------------------------------------------------------

    def _read_plan(self, raw) -> Plan:
        name = _text(raw.Name(), "a method's name")
        values = [_decode_evalue(raw.Values(i)) for i in range(raw.ValuesLength())]
        inputs = [raw.Inputs(i) for i in range(raw.InputsLength())]
        outputs = [raw.Outputs(i) for i in range(raw.OutputsLength())]
        for idx in inputs + outputs:
            if not 0 <= idx < len(values):
                raise PteError(f"{self.path}: method {name} refers to value {idx} out of range")
        delegates = [self._read_delegate(raw.Delegates(i)) for i in range(raw.DelegatesLength())]
        delegate_args, kernel_calls = [], 0
        for c in range(raw.ChainsLength()):
            chain = raw.Chains(c)
            for i in range(chain.InstructionsLength()):
                instr = chain.Instructions(i)
                kind = instr.InstrArgsType()
                if kind == ep.InstructionArguments.DelegateCall:
                    call = ep.DelegateCall()
                    tab = instr.InstrArgs()
                    call.Init(tab.Bytes, tab.Pos)
                    if not 0 <= call.DelegateIndex() < len(delegates):
                        raise PteError(f"{self.path}: method {name} calls a missing delegate")
                    delegate_args.append([call.Args(j) for j in range(call.ArgsLength())])
                elif kind == ep.InstructionArguments.KernelCall:
                    kernel_calls += 1
        return Plan(name, values, inputs, outputs, delegates, delegate_args, kernel_calls)

    def _read_delegate(self, raw) -> DelegateInfo:
        backend_id = _text(raw.Id(), "a delegate's backend id")
        ref = raw.Processed()
        index = ref.Index()
        if ref.Location() == ep.DataLocation.SEGMENT:
            payload = bytes(self.segment(index))
        else:
            if index >= self._program.BackendDelegateDataLength():
                raise PteError(f"{self.path}: delegate data {index} out of range")
            payload = self._program.BackendDelegateData(index).DataAsNumpy().tobytes()
        specs = {}
        for i in range(raw.CompileSpecsLength()):
            spec = raw.CompileSpecs(i)
            specs[_text(spec.Key(), f"{backend_id}'s compile spec {i}")] = (
                spec.ValueAsNumpy().tobytes() if spec.ValueLength() else b""
            )
        return DelegateInfo(backend_id, payload, specs)

    def release_pages(self, start: int = 0, end: int | None = None) -> None:
        """Drop the pages under bytes ``[start, end)`` from this process's
        memory (they stay in the page cache and fault back in if read again).

        Weights are copied into MLX arrays once; without this their file pages
        would stay resident in the mapping too, counting twice in RSS.
        """
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = self.size if end is None else end
        first = start - start % mmap.PAGESIZE  # madvise takes page-aligned starts
        if end > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    def close(self) -> None:
        """Unmap the file; arrays already made from it stay valid."""
        self.buffer.release()
        self._map.close()


def flatbuffer_fault(e: Exception) -> str:
    """What a flatbuffer reader's exception on garbage means, in words."""
    if isinstance(e, struct.error) or "smaller than requested" in str(e):
        return f"an offset or length points past the end of the data ({e})"
    if isinstance(e, TypeError) and "bad number" in str(e):
        return f"a field holds a number out of its type's range ({e})"
    return f"{type(e).__name__}: {e}"


def _text(raw: bytes | None, what: str) -> str:
    if raw is None:
        raise PteError(f"{what} is missing")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise PteError(f"{what} is not UTF-8 text: corrupt file") from None


def _decode_evalue(raw):
    kind = raw.ValType()
    tab = raw.Val()
    K = ep.KernelTypes
    if kind in (K.NONE, K.Null):
        return None
    table = {
        K.Int: ep.Int, K.Bool: ep.Bool, K.Double: ep.Double, K.Tensor: ep.Tensor,
        K.String: ep.String, K.IntList: ep.IntList, K.DoubleList: ep.DoubleList,
        K.BoolList: ep.BoolList, K.TensorList: ep.TensorList,
        K.OptionalTensorList: ep.OptionalTensorList,
    }.get(kind)
    if table is None:
        raise PteError(f"unknown EValue kind {kind}")
    obj = table()
    obj.Init(tab.Bytes, tab.Pos)
    if kind == K.Int:
        return obj.IntVal()
    if kind == K.Bool:
        return bool(obj.BoolVal())
    if kind == K.Double:
        return obj.DoubleVal()
    if kind == K.String:
        return _text(obj.StringVal(), "a string value")
    if kind == K.Tensor:
        return TensorValue(
            scalar_type=obj.ScalarType(),
            sizes=tuple(obj.Sizes(i) for i in range(obj.SizesLength())),
            data_buffer_idx=obj.DataBufferIdx(),
            dynamic=obj.ShapeDynamism() != ep.TensorShapeDynamism.STATIC,
        )
    if kind == K.BoolList:
        return [bool(obj.Items(i)) for i in range(obj.ItemsLength())]
    # Int/Double lists hold values; tensor lists hold indices of other EValues.
    return [obj.Items(i) for i in range(obj.ItemsLength())]
