"""The CPU kernels (runtime/cpu/*.cpp) when something goes wrong: a chunk
of shared work that throws, NaN and infinity among their inputs, a KV pool
that something else still holds."""

import subprocess
import sys

import pytest

# Runs in a child, so that a thread left waiting hangs the child, not the suite.
THROWING_CHUNKS = r"""
import mlx.core as mx
from llm_executorch_mlx.runtime.cpu import extension

ext = extension.build().module

def raised(run):
    try:
        run()
    except RuntimeError as error:
        return str(error)
    return None

# the stream thread alone runs the job (nothing helps): its chunk 3 of 16 throws
print(raised(lambda: mx.eval(ext.debug_throwing_job(16, 3))))
# the host helps: every chunk throws, whichever thread runs it
job = ext.debug_throwing_job(64, -1)
print(raised(lambda: (ext.submit_helping([job]), ext.wait_helping(job))))
# the error reaches the graph's output through the ops that read the failed one
job = ext.debug_throwing_job(64, 40)
out = ext.gemv(ext.gemv(job.reshape(1, 1, 64), mx.ones((64, 8))), mx.ones((8, 8)))
print(raised(lambda: (ext.submit_helping([out]), ext.wait_helping(out))))
# and the stream runs the next job as before (no chunk 8 to throw)
print(ext.debug_throwing_job(8, 8).tolist())
"""


def test_a_chunk_that_throws_reaches_the_caller_and_leaves_no_thread_waiting():
    try:
        done = subprocess.run([sys.executable, "-c", THROWING_CHUNKS], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("a thread waited for ever on a chunk that threw")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "chunk 3 threw"
    assert lines[1].startswith("chunk ") and lines[1].endswith(" threw")
    assert lines[2] == "chunk 40 threw"
    assert lines[3] == str([float(c) for c in range(8)])
