"""The async llm model: the sync model's turn, run on a worker thread.

``llm.get_async_model("pte:x")`` gets this. Each prompt runs ``PteModel``'s
own ``execute`` (so it streams, records and errs exactly as the sync model
does) on one worker thread that the process keeps for async turns, and its
chunks come back to the event loop through a queue: the loop never waits on
a step.

Concurrent async prompts are serialized, one turn at a time, on that
thread: a decode step already keeps every core busy (the host thread helps
the stream), and the session pool and the CPU kernels' shared jobs are per
process. Each conversation still keeps its own session (cache), so
interleaved conversations neither evict nor corrupt each other; a prompt
only waits for the turn ahead of it to finish.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
from concurrent.futures import Future

import llm

from .plugin import InputError, PteModel

_EXIT_WAIT_S = 30  # how long an exit waits for a turn still running on the worker


class AsyncPteModel(llm.AsyncModel):
    can_stream = PteModel.can_stream
    supports_schema = PteModel.supports_schema
    supports_tools = PteModel.supports_tools
    Options = PteModel.Options

    def __init__(self, entry):
        self.entry = entry
        self.model_id = entry.model_id
        self._model = PteModel(entry)

    async def execute(self, prompt, stream, response, conversation):
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        abandoned = threading.Event()  # the caller stopped reading: end the turn at the next chunk

        def send(kind, value=None):
            loop.call_soon_threadsafe(chunks.put_nowait, (kind, value))

        def run_turn():
            turn = self._model.execute(prompt, stream, response, conversation)
            try:
                WORKER.make_default_stream()
                for chunk in turn:
                    send("chunk", chunk)
                    if abandoned.is_set():
                        break
            except BaseException as e:  # raised to the caller, in the event loop
                send("error", e)
            else:
                send("done")
            finally:
                turn.close()  # an interrupted turn leaves its session in step (text/streaming.py)

        worker = asyncio.wrap_future(WORKER.submit(run_turn))
        try:
            while True:
                kind, value = await chunks.get()
                if kind == "done":
                    break
                if kind == "error":
                    raise value
                yield value
            await worker
        finally:
            abandoned.set()


class Worker:
    """One daemon thread that runs the process's async turns in order.

    MLX streams belong to the thread that made them, so the thread makes its
    own default stream before its first turn, and it lives as long as the
    process (a daemon: it never holds up an exit).
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self._stream_made = False

    def submit(self, job) -> Future:
        """Run ``job()`` on the thread after the jobs before it; its future."""
        future: Future = Future()
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llm-executorch-mlx", daemon=True)
                self._thread.start()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as e:
                future.set_exception(e)

    def _release_streams(self) -> None:
        """At exit: finish what is queued on the thread's stream and destroy
        it there (MLX's teardown aborted the process otherwise)."""
        import mlx.core as mx

        def release():
            mx.synchronize()
            mx.clear_streams()

        try:
            self.submit(release).result(timeout=_EXIT_WAIT_S)
        except Exception:  # a turn still running at exit: leave it
            pass

    def make_default_stream(self) -> None:
        """Give this thread (the worker, inside a job) its MLX stream, once."""
        if self._stream_made:
            return
        from .mlx_backend import MlxBackendError, require

        try:
            require()
        except MlxBackendError as e:
            raise InputError(str(e)) from None
        import mlx.core as mx

        mx.set_default_stream(mx.new_stream(mx.default_device()))
        self._stream_made = True
        atexit.register(self._release_streams)


WORKER = Worker()
