"""The front end's handle on an engine core running in its own process (core_process.py).

EngineCoreClient serves the gRPC servicer as AsyncEngine does in process (start/stop,
`generate`, `stats`, `limits`, `compile_grammar`, `fail_streams`), but the scheduler, the KV
cache and the model live in the child; this process keeps the streams, tokenization,
detokenization and stop strings (output_processor.py) and never loads model weights. A request
is validated here, so a bad one is refused before it is sent; the core checks again.

Everything runs on the event loop's thread: generate() adds and aborts, one reader task takes the
core's messages (outputs, the stats after each step) and feeds the streams. A thread waits on
the child: when it exits unasked (killed, out of memory, a failed tensor-parallel rank) every
open stream ends with EngineDead at once, later calls raise it, and on_dead tells the worker.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
import dataclasses
import itertools
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

import msgpack
import tokenizers
import zmq
import zmq.asyncio

from services.worker.config import WorkerConfig
from services.worker.engine.core_process import socket_paths
from services.worker.engine.core_protocol import (EngineDead, EngineLimits, EngineStats, output_from_wire,
                                                  params_to_wire, share_to_wire, stats_from_wire,
                                                  validate_request)
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.output_processor import OutputProcessor, RequestOutput
from services.worker.engine.output_stream import outputs_until_finished
from services.worker.engine.sampling_params import Constraint, SamplingParams
from services.worker.model.tokenizer import Tokenizer

log = logging.getLogger("llmserve.worker")
REPO = Path(__file__).resolve().parents[3]


class EngineCoreClient:
    def __init__(self, cfg: WorkerConfig, on_dead: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.on_dead = on_dead
        self.dead: str | None = None        # why the core is gone (None while it runs)
        self.pid: int | None = None         # the core process
        self.limits: EngineLimits | None = None
        self.vocab_size = 0
        self.dtype = ""
        self.max_context_length = 0
        self.tokenizer: Tokenizer | None = None
        self.processor: OutputProcessor | None = None
        self._grammars = None
        self._stats = EngineStats(0, 0, 0, 0, 0, 0, 0)
        # Open streams by the caller's id. The core knows each request by the caller's id plus a
        # sequence number (_core_ids), so what it still sends for a cancelled request (the processor
        # has forgotten that id) never reaches a new request of the same caller id.
        self._streams: dict[str, asyncio.Queue] = {}
        self._core_ids: dict[str, str] = {}   # core id -> caller id, while the stream is open
        self._sequence = itertools.count()
        self._stopping = False
        self._failure: str | None = None    # what the core said before it exited
        self._dir = tempfile.mkdtemp(prefix="llmserve-core-")
        self._context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._outputs = self._async_context.socket(zmq.PULL)
        self._process: subprocess.Popen | None = None
        self._reader: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the core and wait until it has built the engine (RuntimeError if it could not)."""
        self._loop = asyncio.get_running_loop()
        commands, outputs = socket_paths(self._dir)
        self._commands.setsockopt(zmq.SNDHWM, 0)   # never block the loop: the core takes them in order
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(commands)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(outputs)
        config_path = Path(self._dir) / "config.json"
        config_path.write_text(json.dumps(dataclasses.asdict(self.cfg)))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "services.worker.engine.core_process", str(config_path), self._dir], cwd=REPO)
        self.pid = self._process.pid
        log.info("engine core process %d starting", self.pid)
        self._ready = self._loop.create_future()
        self._reader = asyncio.create_task(self._read(), name="engine-core-reader")
        self._reader.add_done_callback(self._reader_done)
        threading.Thread(target=self._watch, name="engine-core-watch", daemon=True).start()
        info = await self._ready
        self.limits = EngineLimits(**info["limits"])
        self._stats = stats_from_wire(info["stats"])
        self.vocab_size, self.max_context_length = info["vocab_size"], info["max_context_length"]
        self.dtype = info["dtype"]   # the model's, "auto" resolved
        t = info["tokenizer"]
        self.tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(t["json"]), t["bos_token_id"], t["eos_token_ids"],
                                   t["chat_template"])
        self.processor = OutputProcessor(self.tokenizer)
        from services.worker.engine.structured.compiler import GrammarCompiler
        self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self._grammars.warm_up()   # before serving, as the core did: it holds the GIL for a moment

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the core after what it runs (the caller drained the streams first)."""
        self._stopping = True
        if self._process is not None and self._process.poll() is None:
            self._send(["stop"])
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._process.wait, timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine core did not stop within %.0fs; killing it", timeout)
                self._process.kill()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._commands.close(0)
        self._outputs.close(0)
        self._context.term()
        self._async_context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def fail_streams(self, error: EngineDead) -> None:
        """End every open stream with error now (on the event loop's thread)."""
        for q in self._streams.values():
            q.put_nowait(error)

    # -- what the servicer asks --------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The stats the core sent after its latest step (or the latest commands)."""
        return self._stats

    def compile_grammar(self, constraint: Constraint) -> None:
        """Compile (cached) to validate; any thread. ValueError naming the field if it is bad."""
        self._grammars.compile(constraint)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return validate_request(self.limits, self.vocab_size, prompt_token_ids, params, self.compile_grammar)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "",
                       cache_salt: str = "", share: FairShare = FairShare()) -> AsyncIterator[RequestOutput]:
        """Yields outputs of all n choices until every choice has finished.

        Raises ValueError for a bad request before anything is sent, EngineDead once the core is
        gone. Leaving the iteration early (the caller was cancelled) aborts the request."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        request_id = request_id or uuid.uuid4().hex
        self.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        core_id = f"{request_id}.{next(self._sequence)}"
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = outputs
        self._core_ids[core_id] = request_id
        self.processor.add_request(core_id, prompt_token_ids, params, output_id=request_id)
        self._send(["add", core_id, prompt_token_ids, params_to_wire(params), cache_salt, share_to_wire(share)])

        def abort() -> None:
            self.processor.abort(core_id)
            self._send(["abort", [core_id], "abort"])
        try:   # aclosing: a caller that leaves early aborts now, not when the generator is collected
            async with aclosing(outputs_until_finished(outputs, params.n, abort)) as items:
                async for item in items:
                    yield item
        finally:
            self._streams.pop(request_id, None)
            self._core_ids.pop(core_id, None)

    # -- the core's messages -----------------------------------------------------------------

    def _send(self, message: list) -> None:
        if self.dead is None:
            try:
                self._commands.send(msgpack.packb(message), zmq.NOBLOCK)
            except zmq.Again:   # no core connected: it has just died, and the watcher says so
                log.warning("engine core unreachable; dropped a %r command", message[0])

    async def _read(self) -> None:
        while True:
            message = msgpack.unpackb(await self._outputs.recv(), strict_map_key=False)
            kind = message[0]
            if kind == "outputs":
                self._stats = stats_from_wire(message[2])
                self._deliver([output_from_wire(o) for o in message[1]])
            elif kind == "error":   # the core refused an add the front end let through
                self.processor.abort(message[1])
                caller_id = self._core_ids.get(message[1])
                if caller_id is not None:
                    self._streams[caller_id].put_nowait(ValueError(message[2]))
            elif kind == "ready":
                if not self._ready.done():
                    self._ready.set_result(message[1])
            elif kind == "failed":
                log.error("engine core: %s", message[1])
                self._failure = message[1]

    def _deliver(self, core_outputs) -> None:
        outputs, stopped = self.processor.process(core_outputs)
        if stopped:   # the core may run them a step or two more: the processor drops what comes
            self._send(["abort", stopped, "stop"])
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _reader_done(self, task: asyncio.Task) -> None:
        """A reader that failed would leave every stream waiting: end the core, so they all end."""
        if not task.cancelled() and task.exception() is not None:
            log.error("engine core messages could not be handled; stopping the core", exc_info=task.exception())
            self._failure = f"the worker could not handle the engine core's messages: {task.exception()}"
            self._process.kill()

    def _watch(self) -> None:
        """In a thread: wait for the core to exit, then tell the loop."""
        code = self._process.wait()
        self._loop.call_soon_threadsafe(self._exited, code)

    def _exited(self, code: int) -> None:
        if self._stopping and code == 0:
            return
        # The reader may still hold the core's last words ("failed"): give it a moment first.
        self._loop.call_later(0.1, self._die, code)

    def _die(self, code: int) -> None:
        reason = self._failure or f"the engine core process exited with code {code}"
        self.dead = reason
        log.error("engine core process %d is gone: %s", self.pid, reason)
        self.fail_streams(EngineDead(reason))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(reason))
        if self.on_dead is not None and not self._stopping:
            self.on_dead(reason)
