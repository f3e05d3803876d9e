"""The engine on its own thread, streaming to asyncio callers.

The engine thread owns the LLMEngine: callers never touch it. They send commands (add,
abort) through a thread-safe queue and receive outputs on a per-request asyncio queue, so a
forward pass never blocks the event loop and a cancelled caller aborts its request at the
next step boundary.

The servicer's engine client in process (engine.engine_process false); core_client.py is the
same interface over an engine core in its own process: generate, stats, limits,
compile_grammar, fail_streams.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from services.worker.engine.core_protocol import EngineDead, EngineLimits
from services.worker.engine.fair_queue import FairShare
from services.worker.engine.llm_engine import EngineStats, LLMEngine
from services.worker.engine.output_processor import RequestOutput
from services.worker.engine.output_stream import outputs_until_finished
from services.worker.engine.sampling_params import Constraint, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str
    share: FairShare


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._on_step = on_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stats = engine.stats()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    def fail_streams(self, error: EngineDead) -> None:
        """End every open stream with error now (any thread): the engine cannot go on."""
        for request_id in list(self._streams):
            self._send(request_id, error)

    @property
    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after each step (safe to read from any thread)."""
        return self._stats

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def compile_grammar(self, constraint: Constraint) -> None:
        """Compile (cached) to validate; any thread. The engine finds it when the request is added."""
        self.engine.grammars.compile(constraint)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "",
                       cache_salt: str = "", share: FairShare = FairShare()) -> AsyncIterator[RequestOutput]:
        """Yields outputs of all n choices until every choice has finished.

        Raises ValueError for a bad request before anything is queued. Leaving the iteration
        early (the caller was cancelled) aborts the request.
        """
        if not self._thread.is_alive():
            raise EngineDead("the engine thread is not running")
        request_id = request_id or uuid.uuid4().hex
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(_Add(request_id, prompt_token_ids, params, cache_salt, share))

        def abort() -> None:
            self._commands.put(_Abort(request_id))
        try:   # aclosing: a caller that leaves early aborts now, not when the generator is collected
            async with aclosing(outputs_until_finished(outputs, params.n, abort)) as items:
                async for item in items:
                    yield item
        finally:
            self._streams.pop(request_id, None)

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_commands(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed pass must not stop the loop
                outputs = self.engine.fail_step(e)
            self._stats = self.engine.stats()
            self._deliver(outputs)
            if self._on_step is not None:
                self._on_step(outputs)
        for request_id in list(self._streams):
            self._send(request_id, EngineDead("the engine stopped"))

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                            command.cache_salt, command.share)
                except ValueError as e:
                    self._send(command.request_id, e)
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        self._stats = self.engine.stats()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send(output.request_id, output)

    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)
