"""``load_program`` and the Program/Method objects, after ``executorch.runtime``."""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np

from .cache import LayerGeometry, SequenceCache, parse_windows
from .cpu import CpuKernels, kernels
from .dtypes import (
    KV_DTYPES,
    array_from_buffer,
    check_compute_route,
    compute_dtype_map,
    kv_dtype_name,
    mlx_dtype,
    on_cpu,
    scalar_type_name,
)
from .delegate_call import DelegateCall, map_delegate_call
from .errors import PteError
from .interp.interpreter import GraphExecutor
from .interp.layout import (
    for_blas, interleavable_quantized, matmul_weights, weights_read_only_by_matmuls_and_gathers,
)
from .pte._schema import mlx_delegate as md
from .pte.container import Plan, PteFile, TensorValue
from .pte.graph import MAX_RANK, decode_graph, node_name, tensor_fields
from .pte.metadata import MAX_POSITIONS, ForwardSignature, ModelMetadata, read_metadata
from .plan import Layout, Plan
from .steps import PLAIN, Steps

MLX_BACKEND = "MLXBackend"
LLM_METADATA = (
    "get_max_ctx_len", "get_max_context_len", "get_max_seq_len", "get_vocab_size",
    "get_n_caches", "get_prefill_chunk_size", "use_kv_cache",
)


_FAULT_AROUND = 1 << 20  # > Linux's fault-around window (64 KiB by default)


def load_program(path: str | os.PathLike, compute: str = "auto", int8_activations: bool = True,
                 bf16_activations: bool = True) -> "Program":
    """Read and validate a .pte file; raise ``PteError`` saying what is wrong.

    Args:
        path: the .pte file.
        compute: how bf16/fp16 programs compute: "native" in the file's
            dtypes, "fp32" widened at load (outputs too), or "auto": fp32 for
            an LLM program on a CPU, else native (see ``dtypes.COMPUTE_ROUTES``).
            fp32 programs are unaffected.
        int8_activations: on a CPU whose kernels have integer dot products,
            multiply 4/8-bit weights with activations rounded to int8 per
            group (``cpu/quantized_int8.h``; about twice a prefill chunk's
            speed); False keeps them within 2^-16 (``cpu/quantized_dot.h``).
        bf16_activations: on a CPU with AVX512_BF16, multiply bf16 weights
            kept as stored under fp32 compute with activations rounded to
            bf16 (``vdpbf16ps``, about twice a chunk's products' speed);
            False keeps the activations in fp32.
    """
    check_compute_route(compute)  # before the file is read
    return Program(PteFile(path), compute, int8_activations, bf16_activations)


class Method:
    """A loaded method; ``execute(inputs)`` returns its outputs as a list.

    ``submit(*arrays)`` queues arrays computed from its outputs (as
    ``mx.async_eval``) and ``wait(array)`` returns once one is computed: on
    the CPU with the shared GEMV, the host thread helps run the step
    meanwhile; ``queue_on_build``: whether a decode step is queued as soon
    as it is built (``steps.py``).
    """

    def __init__(self, name: str, run, n_inputs: int, op_names: tuple[str, ...] = (), steps: Steps = PLAIN):
        self.name = name
        self._run = run
        self.n_inputs = n_inputs
        self.op_names = op_names  # the ops one call runs, after load-time fusion
        self.submit, self.wait, self.queue_on_build = steps

    def execute(self, inputs: list | tuple = (), last_position_only: bool = False) -> list:
        """Run once. Inputs may be numpy arrays, mx arrays, torch tensors or
        lists; tensor outputs are ``mx.array`` (lazy: evaluate or convert).

        ``last_position_only=True``: only the last position of the first
        output (the logits) will be read, so it may be computed and returned
        for that position alone (``[B, 1, vocab]`` instead of ``[B, T,
        vocab]``) when the program ends in its LM head.
        """
        if len(inputs) != self.n_inputs:
            raise PteError(f"{self.name} takes {self.n_inputs} inputs, got {len(inputs)}")
        return self._run(list(inputs), last_position_only)

    __call__ = execute


class Program:
    """A .pte program: its methods, metadata, and off-graph cache geometry."""

    def __init__(self, pte: PteFile, compute: str = "native", int8_activations: bool = True,
                 bf16_activations: bool = True):
        self.pte = pte
        self.rounding = {"int8_activations": int8_activations, "bf16_activations": bf16_activations}
        self.path = pte.path
        self.method_names = set(pte.plans)
        self._graphs: dict[str, md.MLXGraphT] = {}
        self._calls: dict[str, DelegateCall] = {}
        self._constants: dict[str, list[mx.array]] = {}
        self._interleaved: dict[str, set[int]] = {}  # per method: weights interleaved in _constants
        self._read: dict[str, int] = {}  # per method loaded: bytes of the constants its nodes read
        # Decided once here, never built here: prepare_cpu_kernels() builds.
        self.cpu_kernels: CpuKernels = kernels()
        self.plan = Plan(on_cpu(), self.cpu_kernels, **self.rounding)
        try:
            self.metadata, is_llm = self._read_metadata()
        except PteError as e:  # say which file
            raise e if str(e).startswith(self.path) else PteError(f"{self.path}: {e}") from None
        self._dtype_map = compute_dtype_map(compute, llm=is_llm)

    def _read_metadata(self) -> tuple[ModelMetadata, bool]:
        """The program's metadata, and whether it publishes an LLM's."""
        raw = {}
        for name, plan in self.pte.plans.items():
            if not plan.delegates and not plan.kernel_calls:
                raw[name] = _as_python(self._constant_outputs(plan))
        # Only a program that publishes LLM metadata promises the LLM forward ABI.
        is_llm = "forward" in self.pte.plans and any(k in raw for k in LLM_METADATA)
        forward = self._forward_signature() if is_llm else None
        return read_metadata(raw, forward), is_llm

    # -- methods --------------------------------------------------------------

    def prepare_cpu_kernels(self) -> CpuKernels:
        """Build the CPU kernel extension if it is not built yet (once per
        machine, ~30 s, with a notice on stderr), so that methods loaded from
        now on use it; return what they will use. A generation calls this
        before loading its methods; loading alone never builds.
        """
        prepared = kernels(build=True)
        if prepared != self.cpu_kernels:
            self._constants.clear()  # the weight layout follows the plan
            self._interleaved.clear()
        self.cpu_kernels = prepared
        self.plan = Plan(on_cpu(), prepared, **self.rounding)
        return prepared

    def load_method(self, name: str, cache: SequenceCache | None = None, stage=None) -> Method:
        """Prepare a method to run; delegated methods decode their program now.

        Args:
            name: the method name (see ``method_names``).
            cache: the off-graph cache, required when the program has one.
            stage: a rank's share of the method (``pipeline.py``: its
                layers; ``tensor_parallel.py``: its part of every layer):
                its graph runs, only the parts of constants it reads are loaded.
        """
        plan = self._plan(name)
        if not plan.delegates and not plan.kernel_calls:
            outputs = self._constant_outputs(plan)
            return Method(name, lambda inputs, last_position_only: list(outputs), len(plan.inputs))
        graph = self._graph(name)
        uses_cache = _uses_offgraph_cache(graph)
        if uses_cache and cache is None:
            raise PteError(
                f"{name} uses an off-graph KV cache: build one with "
                "program.new_cache(capacity=...) and pass it as load_method(..., cache=cache)"
            )
        if cache is not None and uses_cache:
            self._check_cache(cache, stage.tensor_ranks if stage is not None else 1)
        key, held, collectives = name, None, None
        if stage is not None:
            graph, held = stage.graph(graph)
            key, collectives = f"{name} {stage}", stage.collectives
        try:
            constants = self._load_constants(key, graph, held)
            taken = self._layouts(graph, constants)
            executor = GraphExecutor(
                graph, constants, cache if uses_cache else None, self._dtype_map, self.plan,
                {w: layout for w, (*_, layout) in taken.items()}, collectives,
            )
            self._interleave(key, executor, taken)
            self._read[name] = sum({id(a): a.nbytes for a in executor.constants if a is not None}.values())
        except (PteError, MemoryError):
            raise
        except Exception as e:  # a corrupt program that passed the load-time checks
            raise PteError(f"{name}: its MLX program cannot be loaded ({type(e).__name__}: {e})") from None
        execute = executor.execute if stage is None else stage.wrap(executor.execute, self._calls[name], self._dtype_map)
        run = self._calls[name].wrap(execute, len(plan.inputs))
        return Method(name, run, len(plan.inputs), tuple(executor.node_names), self.plan.steps)

    def _plan(self, name: str) -> Plan:
        try:
            return self.pte.plans[name]
        except KeyError:
            raise PteError(
                f"{self.path} has no method '{name}' (it has: {', '.join(sorted(self.method_names))})"
            ) from None

    def _constant_outputs(self, plan: Plan) -> list:
        outs = []
        for idx in plan.outputs:
            value = plan.values[idx]
            if isinstance(value, TensorValue):
                value = self._constant_tensor(plan.name, value)
            outs.append(value)
        return outs

    def _constant_tensor(self, method: str, t: TensorValue) -> mx.array:
        if t.data_buffer_idx <= 0:
            raise PteError(f"{method} returns a tensor with no constant data")
        if len(t.sizes) > MAX_RANK or any(d < 0 for d in t.sizes):
            raise PteError(f"{method} returns a tensor of rank {len(t.sizes)}, sizes {list(t.sizes[:8])}...: corrupt file")
        dtype = mlx_dtype(t.scalar_type)
        nbytes = math.prod(t.sizes) * dtype.size  # Python ints: a corrupt shape cannot wrap around
        return array_from_buffer(self.pte.constant_data(t.data_buffer_idx, nbytes), t.sizes, dtype)

    def graph(self, name: str) -> md.MLXGraphT:
        """The MLX program a delegated method runs, decoded (read it, do not change it)."""
        return self._graph(name)

    def _graph(self, name: str) -> md.MLXGraphT:
        graph = self._graphs.get(name)
        if graph is not None:
            return graph
        plan = self._plan(name)
        others = sorted({d.backend_id for d in plan.delegates} - {MLX_BACKEND})
        if others:
            raise PteError(
                f"{name} is delegated to {', '.join(others)}, not {MLX_BACKEND}: "
                "export with the MLX partitioner to run it here"
            )
        if plan.kernel_calls or len(plan.delegates) != 1 or len(plan.delegate_args) != 1:
            raise PteError(
                f"{name} is not a single MLX delegate call ({len(plan.delegates)} delegates, "
                f"{plan.kernel_calls} portable kernel calls): this runtime runs programs "
                "fully delegated to MLXBackend"
            )
        delegate = plan.delegates[0]
        try:
            graph = decode_graph(delegate.payload)
        except PteError as e:
            raise PteError(f"{self.path}: {name}: {e}") from None
        n_in, n_out = len(graph.inputMap or []), len(graph.outputMap or [])
        self._calls[name] = map_delegate_call(
            plan, plan.delegate_args[0], n_in, n_out, lambda t: self._constant_tensor(name, t)
        )
        self._graphs[name] = graph
        return graph

    def _load_constants(self, name: str, graph: md.MLXGraphT,
                        held: dict[int, tuple[slice, ...]] | None = None) -> list[mx.array]:
        """Weights as MLX arrays in the compute route's dtype, shared by every
        load; with ``held``, only its constant slots (the others None, never
        read), each the part its index selects (``()``: the whole)."""
        cached = self._constants.get(name)
        if cached is not None:
            return cached
        names = {}
        for ns in graph.namedSlots or []:
            if ns.slot.slotType == md.SlotType.TensorSlot:
                names[ns.slot.idx] = ns.name.decode() if isinstance(ns.name, bytes) else ns.name
        metas = graph.tensorMeta or []
        blas_weights = matmul_weights(graph) if self.plan.stores_for_blas else set()
        as_stored = self._bf16_kept(graph)
        constants = []
        for tid in range(graph.numConstantTensors):
            if held is not None and tid not in held:
                constants.append(None)
                continue
            key = names.get(tid)
            if key is None or tid >= len(metas) or metas[tid] is None:
                raise PteError(f"{name}: constant tensor {tid} has no name or metadata")
            meta = metas[tid]
            shape = tuple(d.value for d in meta.shape or [])
            if any(d < 0 for d in shape):
                raise PteError(f"{name}: constant '{key}' has a dynamic shape")
            dtype = mlx_dtype(meta.scalarType)
            data = self.pte.named_data(key)
            nbytes = math.prod(shape) * dtype.size
            if len(data) < nbytes:
                raise PteError(
                    f"{name}: constant '{key}' needs {nbytes} bytes, the file holds {len(data)}"
                )
            array = array_from_buffer(data[:nbytes], shape, dtype, held[tid] if held is not None else ())
            array = array.astype(self._held_dtype(tid, dtype, as_stored))
            if tid in blas_weights:
                array = for_blas(array)
            mx.eval(array)  # one tensor at a time: no second full copy at load
            # Now held by MLX only. Reads map pages around the one touched, so
            # also drop a window before this tensor, and all pages at the end.
            start, end = self.pte.named_data_span(key)
            self.pte.release_pages(max(0, start - _FAULT_AROUND), end)
            constants.append(array)
        self.pte.release_pages()
        self._constants[name] = constants
        return constants

    def _layouts(self, graph: md.MLXGraphT, constants: list[mx.array]) -> dict:
        """``{w: (scales, biases, group, bits, layout)}``: the quantized
        weights only the extension's products read (``interp/layout.py``)
        that the plan holds in another layout than MLX's."""
        taken = {}
        for w, (s, b, group, bits) in interleavable_quantized(graph, self.plan.takes_quantized).items():
            weight, scales = constants[w], constants[s]
            if weight.dtype != mx.uint32 or weight.ndim != 2 or scales.dtype != mx.float32:
                continue
            n, k = weight.shape[0], weight.shape[1] * 32 // bits
            layout = self.plan.quantized_layout(bits, group, n, k)
            if layout is not Layout.MLX and scales.shape == (n, k // group):
                taken[w] = (s, b, group, bits, layout)
        return taken

    def _interleave(self, name: str, executor: GraphExecutor, taken: dict) -> None:
        """Interleave ``taken`` in ``executor``'s constants, after its init
        chain computed the biases. The weight, which the init chain never
        reads, is converted once, in the program's shared constants; the
        scales and biases per method loaded."""
        extension, shared = self.plan.products, self._constants[name]
        done = self._interleaved.setdefault(name, set())
        held = executor.constants
        for w, (s, b, group, bits, layout) in taken.items():
            try:
                wi, si, bi = extension.interleave_quantized(held[w], held[s], held[b], group, bits,
                                                            weight=w not in done, int8=layout is Layout.INT8)
            except ValueError as e:
                raise PteError(f"{name}: quantized weight {w} cannot be laid out for the CPU products ({e})") from None
            shared[w] = wi
            done.add(w)
            executor.set_constants({w: wi, s: si, b: bi})

    def _forward_signature(self) -> ForwardSignature:
        plan = self._plan("forward")
        if not plan.outputs:
            raise PteError("forward publishes no outputs")
        logits = plan.values[plan.outputs[0]]
        tokens = plan.values[plan.inputs[0]] if plan.inputs else None
        if not isinstance(logits, TensorValue):
            raise PteError("forward's first output is not a tensor of logits")
        token_bound = None
        if isinstance(tokens, TensorValue) and tokens.sizes:
            token_bound = tokens.sizes[-1]
        graph_dtype = None
        if plan.delegates and plan.delegates[0].backend_id == MLX_BACKEND:
            graph_dtype = _attention_dtype(self._graph("forward"))
        return ForwardSignature(
            n_inputs=len(plan.inputs),
            token_bound=token_bound,
            logits_shape=logits.sizes,
            logits_dtype=scalar_type_name(logits.scalar_type),
            graph_dtype=graph_dtype,
        )

    # -- cache ----------------------------------------------------------------

    def cache_geometry(self, windows=None, tensor_ranks: int = 1) -> list[LayerGeometry]:
        """Per-layer cache geometry the file publishes, with an optional window
        pattern (``"512"``, ``"512,0"``, ``0``...) replacing the model's own;
        each layer's KV heads shared by ``tensor_ranks`` tensor-parallel ranks."""
        m = self.metadata
        if m.has_offgraph_cache:
            heads_dims = list(zip(m.kv_heads, m.head_dims))
            pattern = m.windows if windows is None else parse_windows(windows)
        elif "forward" in self.method_names and self._plan("forward").delegates:
            # No LLM metadata: the geometry the graph's attention nodes read.
            heads_dims = _attended_layers(self._graph("forward"))
            pattern = [0] if windows is None else parse_windows(windows)
        else:
            heads_dims = []
        if not heads_dims:
            raise PteError(
                f"{self.path} publishes no off-graph cache geometry (get_n_caches): "
                "re-export with --use-offgraph-cache"
            )
        return [
            LayerGeometry(heads // tensor_ranks, dim, pattern[i % len(pattern)])
            for i, (heads, dim) in enumerate(heads_dims)
        ]

    def new_cache(
        self,
        capacity: int | None = None,
        dtype: str | None = None,
        initial_capacity: int | None = None,
        windows=None,
        value_dtype: str | None = None,
        held: range | None = None,
        tensor_ranks: int = 1,
    ) -> SequenceCache:
        """Build an off-graph cache for this program.

        Args:
            capacity: most tokens the sequence may hold (default: max context).
            dtype: the keys' storage, "bf16" | "fp16" | "fp32" | "int8" |
                "int4" (default: ``kv_dtype``).
            initial_capacity: starting slots of flat pools (default 512).
            windows: a window pattern replacing the model's own.
            value_dtype: the values' storage (default: ``dtype``).
            held: the layers whose pools this process holds (a pipeline
                rank's); the cache still answers for every layer.
            tensor_ranks: the tensor-parallel ranks sharing each layer's KV
                heads; the pools hold this rank's part.
        """
        m = self.metadata
        layers = self.cache_geometry(windows, tensor_ranks)
        if capacity is None:
            capacity = m.max_context
        if capacity is None:
            raise PteError("the file publishes no max context: pass capacity=")
        if isinstance(capacity, int) and capacity > MAX_POSITIONS:
            raise PteError(f"cache capacity {capacity} is more than the {MAX_POSITIONS} positions MLX can index")
        max_write = m.prefill_chunk
        narrowest = min((g.window for g in layers if g.window > 0), default=0)
        if windows is not None and narrowest and max_write and narrowest < max_write:
            max_write = narrowest  # the chunk follows a narrowed window down
        cache = SequenceCache(
            layers,
            capacity=capacity,
            dtype=dtype or self.kv_dtype,
            value_dtype=value_dtype,
            initial_capacity=initial_capacity,
            max_write=max_write,
            held=held,
        )
        # The pools are lazy until a step evaluates them: a geometry no machine
        # can hold (a corrupt window, an absurd capacity) is refused here.
        need, room = sum(a.nbytes for a in cache.state), _memory_limit()
        if need > room:
            raise PteError(
                f"the cache needs {need / 2**30:.1f} GiB up front (capacity {capacity}, windows "
                f"{sorted({g.window for g in layers})}), more than the {room / 2**30:.1f} GiB this process may use: "
                "pass a smaller capacity= or windows="
            )
        return cache

    def _check_cache(self, cache: SequenceCache, tensor_ranks: int) -> None:
        want = [(g.n_kv_heads, g.head_dim) for g in self.cache_geometry(tensor_ranks=tensor_ranks)]
        if [(g.n_kv_heads, g.head_dim) for g in cache.layers] != want:
            raise PteError(
                "the cache's layer geometry does not match this program's; build it "
                "with program.new_cache(...)"
            )

    @property
    def compute_dtype(self) -> str | None:
        """The dtype activations compute in: the file's, or fp32 when the
        compute route widened a half-precision program."""
        act = self.metadata.activation_dtype
        if act is not None and KV_DTYPES[act] in self._dtype_map:
            return kv_dtype_name(self._dtype_map[KV_DTYPES[act]])
        return act

    @property
    def kv_dtype(self) -> str:
        """A cache's storage unless asked otherwise (``Plan.cache_dtype``)."""
        return self.plan.cache_dtype(self.compute_dtype or "bf16")

    def weight_bytes(self, as_stored: bool = False) -> int:
        """Bytes of every delegated method's constants, from metadata alone:
        as held in memory after the compute route, or ``as_stored`` in the file."""
        total = 0
        for name, plan in self.pte.plans.items():
            if not plan.delegates or plan.delegates[0].backend_id != MLX_BACKEND:
                continue
            graph = self._graph(name)
            kept = self._bf16_kept(graph)
            for tid, meta in enumerate((graph.tensorMeta or [])[: graph.numConstantTensors]):
                n = int(np.prod([d.value for d in meta.shape or []], dtype=np.int64))
                dtype = mlx_dtype(meta.scalarType)
                if not as_stored:
                    dtype = self._held_dtype(tid, dtype, kept)
                total += n * dtype.size
        return total

    def read_bytes(self, name: str = "forward") -> int:
        """Bytes of the constants the loaded method ``name`` reads, as its
        layouts hold them (``weight_bytes`` counts the file's layout; the CPU's
        int8 products read their own, with smaller scales): what one decode
        step streams. 0 before ``load_method(name)``."""
        return self._read.get(name, 0)

    def _bf16_kept(self, graph: md.MLXGraphT) -> set[int]:
        """Constants a program widened to fp32 keeps in bf16 where the plan
        says so: its linear weights and a tied embedding's table (the
        products widen them as they read them; a long chunk widens per
        product, interp/ops/nn.py; a gather widens the rows it takes)."""
        if not self.plan.keeps_bf16(self._dtype_map.get(mx.bfloat16, mx.bfloat16) == mx.float32):
            return set()
        return weights_read_only_by_matmuls_and_gathers(graph)

    def _held_dtype(self, tid: int, dtype: mx.Dtype, bf16_kept: set[int]) -> mx.Dtype:
        if dtype == mx.bfloat16 and tid in bf16_kept:
            return dtype
        return self._dtype_map.get(dtype, dtype)

    @property
    def prefill_chunk(self) -> int | None:
        """Most tokens one forward call may take (also the ring max write)."""
        return self.metadata.prefill_chunk

    def close(self) -> None:
        self.pte.close()


def _memory_limit() -> int:
    """Bytes this process may allocate at most: physical memory, or less under
    an address-space limit."""
    import resource

    room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return room if soft == resource.RLIM_INFINITY else min(room, soft)


def _uses_offgraph_cache(graph: md.MLXGraphT) -> bool:
    return any(
        node_name(i) == "UpdateAndAttendNode"
        for chain in graph.instructionChains
        for i in chain.instructions or []
    )


def _attended_layers(graph: md.MLXGraphT) -> list[tuple[int, int]]:
    """``(n_kv_heads, head_dim)`` per cache layer, from the keys each
    ``UpdateAndAttendNode`` writes ([B, H_kv, T, D]); [] when there is none.

    A key that is a temporary has no metadata of its own; its shape is then
    followed through the elementwise nodes that made it (a scale, a cast).
    """
    metas, layers = graph.tensorMeta or [], {}
    shapes = {
        tid: [d.value for d in m.shape or []] for tid, m in enumerate(metas) if m is not None
    }
    for chain in graph.instructionChains:
        for i in chain.instructions or []:
            name, op = node_name(i), i.op
            if name in _SHAPE_KEEPING and getattr(op, "out", None) is not None:
                reads = [shapes.get(t, []) for t in sorted(tensor_fields(op)[0])]
                shapes[op.out.idx] = max(reads, key=len, default=[])
            if name != "UpdateAndAttendNode" or op.layerId is None or op.k is None:
                continue
            shape = shapes.get(op.k.idx, [])
            if len(shape) != 4 or min(shape[1], shape[3]) <= 0:
                raise PteError(f"UpdateAndAttendNode of layer {op.layerId}: its keys are not [B, H, T, D]")
            if layers.setdefault(op.layerId, (shape[1], shape[3])) != (shape[1], shape[3]):
                raise PteError(f"layer {op.layerId}'s attention nodes write keys of different shapes")
    if layers and sorted(layers) != list(range(len(layers))):
        raise PteError(f"the attention nodes' layers {sorted(layers)} are not 0..{len(layers) - 1}")
    return [layers[i] for i in range(len(layers))]


# Nodes whose output has the shape of their largest operand.
_SHAPE_KEEPING = {
    "AsTypeNode", "MultiplyNode", "AddNode", "SubtractNode", "DivideNode", "NegNode",
    "ContiguousNode", "IdCopyNode",
}


def _attention_dtype(graph: md.MLXGraphT) -> str | None:
    """The dtype attention computes in: the out_dtype of the first cache node."""
    for chain in graph.instructionChains:
        for i in chain.instructions or []:
            if node_name(i) == "UpdateAndAttendNode" and i.op.outDtype is not None:
                return kv_dtype_name(mlx_dtype(i.op.outDtype))
    return None


def _as_python(values: list):
    """A constant method's result as plain Python: one value, or a list."""
    out = [v.tolist() if isinstance(v, mx.array) else v for v in values]
    return out[0] if len(out) == 1 else out
