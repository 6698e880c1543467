"""Cache states saved on disk: a new process starts warm, and its replies are
those of transformers on the history with the ids generated before in it.

"A new process" is either a real one (``llm`` run as a subprocess) or this
one with everything a process keeps between turns forgotten (``forget``):
its sessions, the ids of its replies and its truncation cuts. The
references are transformers (``models.hf_turns``, ``models.hf_greedy``) and
a run with the disk states off (``-o kv_disk_mb 0``).
"""

import json
import os
import subprocess
import sys

import llm
import pytest
from click.testing import CliRunner
from llm.cli import cli

import models
from models import make_tokenizer

from llm_executorch_mlx.plugin import saved_states_dir
from llm_executorch_mlx.text import store

USER_TURNS = ["Hello there", "Tell me a story about a cat", "Why is the sky blue?"]
LLM = [sys.executable, "-m", "llm"]


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    forget()
    yield tmp_path / "llm"
    forget()


def forget():
    """What a new process starts with: no sessions, no remembered replies or cuts."""
    store.POOL.clear()
    store.REPLIES.clear()
    store.TRUNCATIONS.clear()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer(directory)
    return directory


@pytest.fixture
def tiny(exported, tokenizer_dir):
    """The llama fixture registered as pte:tiny: (pte, tokenizer dir, hf dir)."""
    model_dir, pte = exported("llama")
    register(pte, tokenizer_dir)
    return pte, tokenizer_dir, model_dir


def register(pte, tokenizer_dir, name="tiny"):
    r = invoke("pte", "register", str(pte), "--tokenizer", str(tokenizer_dir / "tokenizer.json"), "--name", name,
               "--force")
    assert r.exit_code == 0, r.output


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def states():
    return sorted(saved_states_dir().glob("*.safetensors"))


def last_logged(n=1):
    return json.loads(invoke("logs", "-n", n, "--json").output)


def run(args, env):
    return subprocess.run(LLM + args, capture_output=True, text=True, env=env, check=True).stdout.rstrip("\n")


def test_continue_in_new_processes_loads_the_saved_state_and_equals_one_process(tiny, user_dir):
    """`llm -c` in a new process each turn: the previous state is loaded, only
    the new tokens are prefilled, and each reply is transformers' on the
    history holding the ids generated before (as one process holding the
    conversation answers), not on the replies re-tokenized from their text."""
    pte, tok_dir, model_dir = tiny
    env = dict(os.environ, LLM_USER_PATH=str(user_dir))
    reference = models.hf_turns(tok_dir, model_dir, USER_TURNS, 8)
    assert run(["-m", "pte:tiny", USER_TURNS[0], "-o", "max_tokens", "8"], env) == reference[0][2]
    for text, (ids, _, expected) in zip(USER_TURNS[1:], reference[1:]):
        assert run(["-c", text, "-o", "max_tokens", "8"], env) == expected
    logged = last_logged(3)  # oldest first
    assert [e["response_json"]["cache_path"] for e in logged] == ["cold", "disk", "disk"]
    for e, previous, (ids, _, _) in zip(logged[1:], logged, reference[1:]):
        j = e["response_json"]
        assert e["input_tokens"] == len(ids)
        # all the previous process held is loaded and counted as cached; the rest prefilled
        assert j["disk_loaded_tokens"] == j["cached_tokens"] == previous["response_json"]["cache_length"] > 0
        assert j["prefilled_tokens"] == len(ids) - j["cached_tokens"]
        assert json.loads(e["token_details"]) == {"cached": j["cached_tokens"]}
        assert j["disk_load_s"] > 0 and j["disk_save_s"] > 0
    assert len(states()) == 1  # each turn's state supersedes the one it continued


def test_with_disk_states_off_a_new_process_reprefills_the_text_history(tiny, user_dir):
    """-o kv_disk_mb 0: nothing is saved or loaded, and the history comes back
    as text, tokenized again as transformers' template does."""
    pte, tok_dir, model_dir = tiny
    env = dict(os.environ, LLM_USER_PATH=str(user_dir))
    first = run(["-m", "pte:tiny", "Hello there", "-o", "max_tokens", "6", "-o", "kv_disk_mb", "0"], env)
    assert first == models.hf_greedy(tok_dir, model_dir, [{"role": "user", "content": "Hello there"}], 6)[1]
    second = run(["-c", "Tell me a story", "-o", "max_tokens", "6", "-o", "kv_disk_mb", "0"], env)
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "Tell me a story"}]
    ids, expected = models.hf_greedy(tok_dir, model_dir, history, 6)
    assert second == expected
    logged = last_logged()[0]
    assert logged["response_json"]["cache_path"] == "cold" and logged["input_tokens"] == len(ids)
    assert states() == []


def test_ring_layers_past_their_window_load_from_disk_in_new_processes(exported, tokenizer_dir, user_dir):
    """gemma3's sliding layers (window 16): `llm -c` in a new process each
    turn loads the state, which holds their last cells only, and each reply
    is transformers' on the history holding the ids generated before."""
    model_dir, pte = exported("gemma3")
    register(pte, tokenizer_dir)
    env = dict(os.environ, LLM_USER_PATH=str(user_dir))
    reference = models.hf_turns(tokenizer_dir, model_dir, USER_TURNS, 10)
    for i, (text, (_, _, expected)) in enumerate(zip(USER_TURNS, reference)):
        assert run((["-m", "pte:tiny"] if i == 0 else ["-c"]) + [text, "-o", "max_tokens", "10"], env) == expected
    logged = last_logged(3)  # oldest first
    assert [e["response_json"]["cache_path"] for e in logged] == ["cold", "disk", "disk"]
    for e, previous, (ids, _, _) in zip(logged[1:], logged, reference[1:]):
        j = e["response_json"]
        assert e["input_tokens"] == len(ids)
        assert j["disk_loaded_tokens"] == previous["response_json"]["cache_length"] > 16  # past the window
        assert j["prefilled_tokens"] == len(ids) - j["disk_loaded_tokens"]
    # a sliding layer's arrays hold its window's cells, a full layer all of them
    import mlx.core as mx

    (path,) = states()  # the last turn's, which superseded the others
    arrays, meta = mx.load(str(path), return_metadata=True)
    length = logged[-1]["response_json"]["cache_length"]
    # the cells a sliding layer holds: its window and a chunk's worth less one
    # (16 + 16 - 1), those a step after any rewind the cache allows still reads
    assert [arrays[f"k.{i}"].shape[2] for i in range(3)] == [31, 31, length]
    assert json.loads(meta["state"])["floor"] == length - 16  # it gives prefixes down to a chunk back


def test_a_quantized_cache_saved_on_disk_continues_as_the_live_one(exported, tokenizer_dir, user_dir):
    """int8 keys and int4 values on gemma3 (sliding and full layers): a new
    process each turn loads the state, stored as the cache holds it (each
    history's words, scales and biases), and answers as one process holding
    the conversation live does; the bytes reported are the quantized ones."""
    import mlx.core as mx

    model_dir, pte = exported("gemma3")
    register(pte, tokenizer_dir)
    opts = ["-o", "max_tokens", "10", "-o", "kv_storage_dtype", "int8", "-o", "kv_value_dtype", "int4"]
    replies = {}
    for how in ("live", "disk"):
        for i, text in enumerate(USER_TURNS):
            if how == "disk":
                forget()
            r = invoke(*(["-m", "pte:tiny"] if i == 0 else ["-c"]), text, *opts,
                       *(["-o", "kv_disk_mb", "0"] if how == "live" else []))
            assert r.exit_code == 0, r.output
            replies.setdefault(how, []).append(r.output)
        logged = last_logged(3)
        assert [e["response_json"]["cache_path"] for e in logged] == (
            ["cold", "hit", "hit"] if how == "live" else ["cold", "disk", "disk"])
    assert replies["disk"] == replies["live"]
    j = logged[-1]["response_json"]
    assert (j["kv_storage_dtype"], j["kv_value_dtype"]) == ("int8", "int4")
    # per token and layer: 2 kv heads of 32 values, int8 32 + int4 16 bytes, 4 bytes of scale and bias each
    assert j["kv_bytes_in_use"] == 2 * (32 + 4 + 16 + 4) * (2 * 31 + j["cache_length"])
    info = json.loads(invoke("pte", "info", "tiny", "--json").output)["kv_bytes_per_token"]
    assert info["int8/int4"] == 3 * 2 * (32 + 4 + 16 + 4) and info["int8"] == 3 * 2 * 2 * (32 + 4)
    (path,) = states()
    arrays = mx.load(str(path))
    assert [(arrays[f"k.2{f}"].dtype, arrays[f"k.2{f}"].shape[-1]) for f in ("", ".1", ".2")] == [
        (mx.uint32, 8), (mx.float16, 1), (mx.float16, 1)]
    assert arrays["v.2"].shape[-1] == 4 and arrays["v.2"].shape[2] == j["cache_length"]


# `llm` on a disk where writing a saved state takes 30 s a write call: the
# state's first bytes are written, then it waits (the test interrupts it there)
SLOW_DISK_LLM = """
import sys, time
import mlx.core as mx

class SlowDisk:
    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, data):
        n = self.f.write(data)
        self.f.flush()
        print("[slow disk] writing the state", file=sys.stderr, flush=True)
        # 30 s in short sleeps: Linux may hand the SIGINT to another of the
        # process's threads (MLX's, BLAS's), and Python then raises it in the
        # main thread only at its next bytecode, as after a real write call
        for _ in range(300):
            time.sleep(0.1)
        return n

save = mx.save_safetensors
mx.save_safetensors = lambda f, arrays, **kw: save(SlowDisk(f), arrays, **kw)
from llm.cli import cli
cli(prog_name="llm")
"""


def test_ctrl_c_while_a_state_is_written_stops_at_once_and_leaves_no_state(tiny, user_dir):
    """A real SIGINT to `llm -c` while it writes the state after the reply:
    the reply was printed, the process ends at once (as llm ends on any
    Ctrl-C: "Aborted!", the turn not logged), no temp or half-written state
    is left, and the next `llm -c` continues from the previous turn's state
    as transformers does on that history."""
    import select
    import signal
    import time

    pte, tok_dir, model_dir = tiny
    env = dict(os.environ, LLM_USER_PATH=str(user_dir))
    first = models.hf_turns(tok_dir, model_dir, USER_TURNS[:2], 8)
    assert run(["-m", "pte:tiny", USER_TURNS[0], "-o", "max_tokens", "8"], env) == first[0][2]
    (before,) = states()
    saved = before.read_bytes()
    p = subprocess.Popen([sys.executable, "-c", SLOW_DISK_LLM, "-c", USER_TURNS[1], "-o", "max_tokens", "8"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        err = b""
        while b"[slow disk]" not in err:
            line = p.stderr.readline()
            assert line, (err + p.stderr.read()).decode()  # it ended before writing a state
            err += line
        assert select.select([p.stdout], [], [], 10)[0]
        printed = os.read(p.stdout.fileno(), 1 << 16).decode()  # before the interrupt
        assert printed == first[1][2]  # the reply, printed before its state is written
        assert list(user_dir.glob("executorch-mlx-states/.*.tmp"))  # the state is being written
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, rest = p.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        p.kill()
    err = (err + rest).decode()
    assert p.returncode == 1 and err.rstrip().endswith("Aborted!") and "Traceback" not in err, err
    assert took < 5  # not held until the write ends (30 s a write call)
    assert out == b""
    assert list(user_dir.glob("executorch-mlx-states/.*")) == []  # its temp file removed
    assert states() == [before] and before.read_bytes() == saved
    logged = last_logged(2)
    assert len(logged) == 1  # llm logs no interrupted turn: the next -c continues the first
    expected = models.hf_turns(tok_dir, model_dir, [USER_TURNS[0], USER_TURNS[2]], 8)[1][2]
    assert run(["-c", USER_TURNS[2], "-o", "max_tokens", "8"], env) == expected
    j = last_logged()[0]["response_json"]
    assert j["cache_path"] == "disk" and j["disk_loaded_tokens"] == logged[0]["response_json"]["cache_length"]


def test_a_system_prompt_reused_in_another_process_starts_warm(tiny):
    pte, tok_dir, model_dir = tiny
    system = "You are a helpful assistant who answers about cats and the sky in short sentences."
    model = llm.get_model("pte:tiny")
    for i, question in enumerate(["Tell me a story", "Why is the sky blue?"]):
        forget()
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids, expected = models.hf_greedy(tok_dir, model_dir, messages, 8)
        r = model.prompt(question, system=system, max_tokens=8)
        assert r.text() == expected
        j = r.response_json
        if i:
            system_ids = models.hf_greedy(tok_dir, model_dir, messages[:1], 0)[0]
            assert j["cache_path"] == "disk" and j["cached_tokens"] >= len(system_ids) - 5
            assert j["prefilled_tokens"] == len(ids) - j["cached_tokens"]
    assert len(states()) == 2  # two conversations sharing only the system prompt


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif how == "flipped":  # one bit of the last layer's values
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif how == "garbage":
        path.write_bytes(b"\x00" * 64 + data[64:])
    elif how == "edited-ids":  # the header's first id changed (say, by hand), the arrays intact
        at = data.index(b'\\"ids\\": [') + len(b'\\"ids\\": [')
        path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage", "edited-ids", "foreign"])
def test_a_damaged_or_foreign_state_is_noted_deleted_and_never_used(tiny, exported, tokenizer_dir, how, capsys):
    pte, tok_dir, model_dir = tiny
    model = llm.get_model("pte:tiny")
    first = model.prompt(USER_TURNS[0], max_tokens=8).text()
    (path,) = states()
    if how == "foreign":  # a state of another model (gemma3) under this state's name
        gemma_dir, gemma = exported("gemma3")
        register(gemma, tokenizer_dir, "other")
        forget()
        llm.get_model("pte:other").prompt(USER_TURNS[0], max_tokens=4).text()
        other = next(p for p in states() if p != path)
        os.replace(other, path)
    else:
        _damage(path, how)
    capsys.readouterr()
    forget()
    r = model.prompt(USER_TURNS[1], messages=[llm.user(USER_TURNS[0]), llm.assistant(first)], max_tokens=8)
    text = r.text()
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and note.startswith(f"[pte] ignored the saved cache state {path.name}: ")
    assert note.rstrip().endswith("deleted it")
    assert r.response_json["cache_path"] == "cold"
    # the same tokens as with no state at all: transformers on the history,
    # with the first reply's generated ids where the header checked out
    # (its arrays did not), else its text tokenized again
    if how in ("truncated", "flipped"):
        expected = models.hf_turns(tok_dir, model_dir, USER_TURNS[:2], 8)[1][2]
    else:
        history = [{"role": "user", "content": USER_TURNS[0]}, {"role": "assistant", "content": first},
                   {"role": "user", "content": USER_TURNS[1]}]
        expected = models.hf_greedy(tok_dir, model_dir, history, 8)[1]
    assert text == expected
    assert path not in states() or how == "foreign"  # deleted (a new one saved under a new name)


def test_two_processes_continuing_the_same_conversation_at_once_both_answer_right(tiny, user_dir):
    pte, tok_dir, model_dir = tiny
    env = dict(os.environ, LLM_USER_PATH=str(user_dir))
    reference = models.hf_turns(tok_dir, model_dir, USER_TURNS[:2], 8)
    assert run(["-m", "pte:tiny", USER_TURNS[0], "-o", "max_tokens", "8"], env) == reference[0][2]
    # --no-log: llm's own log database refuses a second writer at once ("database is locked")
    racing = [subprocess.Popen(LLM + ["-c", USER_TURNS[1], "-o", "max_tokens", "8", "--no-log"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outputs = [p.communicate() for p in racing]
    assert [p.returncode for p in racing] == [0, 0], outputs
    assert [out.rstrip("\n") for out, _ in outputs] == [reference[1][2]] * 2
    assert all("[pte]" not in err for _, err in outputs)
    (path,) = states()  # both saved the same conversation: one whole state
    forget()
    model = llm.get_model("pte:tiny")
    r = model.prompt(USER_TURNS[2], max_tokens=8, messages=[
        llm.user(USER_TURNS[0]), llm.assistant(reference[0][2]), llm.user(USER_TURNS[1]),
        llm.assistant(reference[1][2])])
    assert r.text() == models.hf_turns(tok_dir, model_dir, USER_TURNS, 8)[2][2]
    assert r.response_json["cache_path"] == "disk"


def test_a_changed_model_file_invalidates_its_states(exported, tokenizer_dir, tmp_path):
    model_dir, pte = exported("llama")
    copy = tmp_path / "model.pte"
    copy.write_bytes(pte.read_bytes())
    register(copy, tokenizer_dir)
    model = llm.get_model("pte:tiny")
    first = model.prompt(USER_TURNS[0], max_tokens=8).text()
    (old,) = states()
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed
    forget()
    r = model.prompt(USER_TURNS[1], messages=[llm.user(USER_TURNS[0]), llm.assistant(first)], max_tokens=8)
    r.text()
    assert r.response_json["cache_path"] == "cold"
    assert old not in states() and len(states()) == 1  # the stale state deleted when the new one was saved


def test_the_budget_keeps_the_most_recently_used_states(tiny):
    """A budget of about two states keeps the new one and the most recently
    used (saved or loaded) other."""
    model = llm.get_model("pte:tiny")
    questions = ["Tell me a story", "Why is the sky blue?", "Numbers like 42", "Hello there"]
    for q in questions[:3]:
        model.prompt(q, max_tokens=4).text()
    saved = {p: p.stat().st_size for p in states()}
    assert len(saved) == 3
    forget()
    again = model.prompt(questions[0], max_tokens=4)  # loaded: now the most recently used
    again.text()
    assert again.response_json["cache_path"] == "disk"
    (recent,) = set(states()) & {p for p in saved if p.stat().st_mtime == max(q.stat().st_mtime for q in saved)}
    forget()
    budget_mb = (2 * max(saved.values()) + 1000) / 2**20
    model.prompt(questions[3], max_tokens=4, kv_disk_mb=budget_mb).text()
    kept = states()
    assert len(kept) == 2 and recent in kept and len(set(kept) - set(saved)) == 1


def test_pte_cache_lists_and_clears_the_states(tiny):
    model = llm.get_model("pte:tiny")
    model.prompt("Hello there", max_tokens=4).text()
    forget()
    model.prompt("Why is the sky blue?", max_tokens=4).text()
    r = invoke("pte", "cache")
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("2 states, ")
    assert all(str(tiny[0]) in line and "tokens" in line and "MB" in line for line in lines[:2])
    r = invoke("pte", "cache", "clear")
    assert r.exit_code == 0 and r.output.startswith("Deleted 2 saved cache states")
    assert states() == []
    assert invoke("pte", "cache").output.startswith("No saved cache states")


ODD_PATHS = ["a file", "a link to nothing", "a symlink loop"]


def _odd_states_path(odd):
    """The states path made a file, a dangling link or a path no one can read
    (a symlink loop: root too); what our one line says of it."""
    path = saved_states_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    if odd == "a file":
        path.write_text("a file where the directory would be")
        return f"{path} is a file, not the directory of saved cache states: move or delete it"
    if odd == "a link to nothing":
        path.symlink_to("gone")
        return f"{path} is a link to gone, which does not exist: create that directory or delete the link"
    path.symlink_to(path.name)
    return f"cannot read the saved cache states in {path} (Too many levels of symbolic links): fix or delete that path"


@pytest.mark.parametrize("odd", ODD_PATHS)
def test_a_state_that_cannot_be_saved_is_a_note_and_the_reply_stands(tiny, capsys, odd):
    pte, tok_dir, model_dir = tiny
    problem = _odd_states_path(odd)
    expected = models.hf_greedy(tok_dir, model_dir, [{"role": "user", "content": "Hello there"}], 6)[1]
    capsys.readouterr()
    r = llm.get_model("pte:tiny").prompt("Hello there", max_tokens=6)
    assert r.text() == expected
    assert capsys.readouterr().err == f"[pte] could not save the cache state: {problem}\n"
    assert r.response_json["cache_path"] == "cold" and r.response_json["disk_save_s"] is None


@pytest.mark.parametrize("odd", ODD_PATHS)
@pytest.mark.parametrize("command", [["pte", "cache"], ["pte", "cache", "clear"]])
def test_pte_cache_on_a_states_path_it_cannot_read_is_one_line_naming_it_and_the_fix(user_dir, odd, command):
    problem = _odd_states_path(odd)
    before = os.readlink(saved_states_dir()) if odd != "a file" else saved_states_dir().read_text()
    r = CliRunner().invoke(cli, command)
    assert r.exit_code == 1 and r.output == f"Error: {problem}\n"
    assert (os.readlink(saved_states_dir()) if odd != "a file" else saved_states_dir().read_text()) == before


def test_a_directory_under_a_state_name_is_noted_as_not_deleted(user_dir):
    (saved_states_dir() / "x.safetensors").mkdir(parents=True)
    r = CliRunner().invoke(cli, ["pte", "cache"])
    assert r.exit_code == 0 and r.stdout.startswith("No saved cache states in ")
    assert r.stderr == ("[pte] ignored the saved cache state x.safetensors: unreadable (Is a directory); "
                        "could not delete it (Is a directory): delete it by hand\n")
    r = CliRunner().invoke(cli, ["pte", "cache", "clear"])
    assert r.exit_code == 0 and r.output == "Deleted 0 saved cache states (0.00 MB)\n"
    assert (saved_states_dir() / "x.safetensors").is_dir()


def test_inside_one_process_the_next_turn_continues_the_live_session(tiny):
    """The live session holds a reply less its last token (never fed), and an
    earlier, longer reply to the same prompt saved a state holding one token
    more of the next prompt: the turn still continues the live session."""
    _, tok_dir, model_dir = tiny
    model = llm.get_model("pte:tiny")
    model.prompt(USER_TURNS[0], max_tokens=12).text()
    conversation = model.conversation()
    conversation.prompt(USER_TURNS[0], max_tokens=6).text()
    second = conversation.prompt(USER_TURNS[1], max_tokens=6)
    assert second.text() == models.hf_turns(tok_dir, model_dir, USER_TURNS[:2], 6)[1][2]
    assert second.response_json["cache_path"] == "hit" and second.response_json["disk_loaded_tokens"] == 0


def test_after_a_cut_the_next_process_continues_from_the_saved_state(tiny, capsys):
    """A conversation outgrew the cache and its oldest turns were left out;
    the next turn, in a new process, makes the same cut (the state records
    it), so it loads that state and prefills only its own tokens."""
    model = llm.get_model("pte:tiny")
    history, rows = [], []
    for text in ["Hello there", "Tell me a story about a cat", "Why is the sky blue?", "The quick brown fox",
                 "Numbers like 42", "How are you today?"]:
        forget()
        r = model.prompt(text, messages=history, max_tokens=16)
        history += [llm.user(text), llm.assistant(r.text())]
        rows.append((r.response_json, "oldest messages" in capsys.readouterr().err))
    first_cut = next(i for i, (_, cut) in enumerate(rows) if cut)
    after, previous = rows[first_cut + 1][0], rows[first_cut][0]
    assert after["cache_path"] == "disk" and after["disk_loaded_tokens"] == previous["cache_length"]
