"""The engine core's process: `python -m services.worker.engine.core_process CONFIG_JSON IPC_DIR`,
started by the worker's front end (core_client.py), never by hand.

It builds the engine from the worker configuration's model and engine sections (build.py; tensor
parallel ranks are started from here too), warms the grammar compiler, says it is ready (with
what the front end needs: limits, vocabulary size, the tokenizer), then loops: apply the
commands that came in, run a step, send its outputs and the stats after it.

Wire (msgpack lists over two ipc:// PUSH/PULL sockets the front end binds in IPC_DIR):
  front -> core: ["add", id, prompt ids, params, cache salt, share] | ["abort", ids, status] | ["stop"]
  core -> front: ["ready", info] | ["outputs", [EngineCoreOutput...], stats] | ["error", id, message]
                 | ["failed", reason]
The core never decides to stop on its own account except on failure: it ignores SIGTERM and
SIGINT (a signal to the process group is the front end's to handle: it drains, then sends
"stop") and exits when its parent is gone, so a killed front end leaves no orphan holding a GPU.
"""

from __future__ import annotations

import os

from services.worker.openmp import set_wait_policy

set_wait_policy()   # before torch loads OpenMP

import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import msgpack  # noqa: E402
import zmq  # noqa: E402

from llmserve.config import from_dict  # noqa: E402
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.engine.core_protocol import (params_from_wire, share_from_wire,  # noqa: E402
                                                  stats_to_wire)

log = logging.getLogger("llmserve.worker.core")
IDLE_POLL_MS = 200   # how often an idle core checks that its front end is still there


def socket_paths(ipc_dir: str | Path) -> tuple[str, str]:
    """(commands, outputs) addresses in the front end's directory."""
    return f"ipc://{Path(ipc_dir) / 'commands'}", f"ipc://{Path(ipc_dir) / 'outputs'}"


class CoreLoop:
    def __init__(self, core, commands: zmq.Socket, outputs: zmq.Socket) -> None:
        from services.worker.engine.request import RequestStatus
        self._status = RequestStatus
        self.core = core
        self.commands, self.outputs = commands, outputs
        self.parent = os.getppid()
        self.failure: str | None = None   # set from any thread (a tensor-parallel rank died)

    def fail(self, reason: str) -> None:
        self.failure = reason

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.commands, zmq.POLLIN)
        while True:
            if os.getppid() != self.parent:
                log.error("the worker front end is gone; the engine core exits")
                return 1
            if self.failure is not None:
                self._send(["failed", self.failure])
                return 1
            busy = self.core.has_work()
            applied = False
            if poller.poll(0 if busy else IDLE_POLL_MS):
                applied, stop = self._apply_commands()
                if stop:
                    return 0
            if self.core.has_work():
                try:
                    outputs = self.core.step()
                except Exception as e:   # a failed pass must not stop the loop
                    outputs = self.core.fail_step(e)
                if self.failure is not None:
                    continue   # the streams end with the failure, not with the aborts it caused
                self._send(["outputs", outputs, stats_to_wire(self.core.stats())])
            elif applied:   # aborts freed blocks: the load report must show it
                self._send(["outputs", [], stats_to_wire(self.core.stats())])

    def _apply_commands(self) -> tuple[bool, bool]:
        """Every command that has come in. -> (any applied, stop asked)."""
        applied = False
        while True:
            try:
                message = msgpack.unpackb(self.commands.recv(zmq.NOBLOCK), strict_map_key=False)
            except zmq.Again:
                return applied, False
            applied = True
            kind = message[0]
            if kind == "add":
                _, request_id, prompt, params, salt, share = message
                try:
                    self.core.add_request(request_id, prompt, params_from_wire(params), salt, share_from_wire(share))
                except ValueError as e:
                    self._send(["error", request_id, str(e)])
            elif kind == "abort":
                self.core.abort_requests(message[1], self._status(message[2]))
            elif kind == "stop":
                return applied, True

    def _send(self, message: list) -> None:
        self.outputs.send(msgpack.packb(message))


def ready_info(built) -> dict:
    engine, tokenizer = built.engine, built.loaded.tokenizer
    limits = engine.limits
    return {
        "limits": {f: getattr(limits, f) for f in limits.__dataclass_fields__},
        "vocab_size": engine.vocab_size,
        "dtype": built.dtype_name,
        "max_context_length": built.loaded.config.max_context_length,
        "tokenizer": {"json": tokenizer.backend.to_str(), "bos_token_id": tokenizer.bos_token_id,
                      "eos_token_ids": tokenizer.eos_token_ids, "chat_template": tokenizer.chat_template},
        "stats": stats_to_wire(engine.stats()),
        "pid": os.getpid(),
    }


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the front end dies, even mid-load (the loop's
    parent check covers the rest)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# Young-generation collections every 700 net allocations ran about once a step at 256 sequences
# (~0.35 ms each on the CPU); a step's objects die by reference count well before 50,000.
GC_GEN0_THRESHOLD = 50_000


def tune_gc() -> None:
    """After start-up: what exists now (model, tokenizer, compiled grammars) is frozen out of every
    collection (as vLLM does), and the young generation is collected less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config_path, ipc_dir = argv
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = from_dict(WorkerConfig, json.loads(Path(config_path).read_text()))
    context = zmq.Context()
    commands_address, outputs_address = socket_paths(ipc_dir)
    commands, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    commands.connect(commands_address)
    outputs.connect(outputs_address)
    outputs.setsockopt(zmq.LINGER, 2000)   # a last "failed" gets out before exit
    try:
        from services.worker.engine.build import build_engine
        from services.worker.engine.warm_up import warm_up
        built = build_engine(cfg.model, cfg.engine)
        built.engine.grammars.warm_up()
        if cfg.engine.warm_up:
            log.info("engine warmed up in %.1f s", warm_up(built.engine.core))
    except Exception as e:
        log.exception("the engine core could not start")
        outputs.send(msgpack.packb(["failed", f"the engine could not start: {e}"]))
        return 1
    tune_gc()
    loop = CoreLoop(built.engine.core, commands, outputs)
    if built.parallel is not None:   # a rank died: the core cannot step, so it reports and exits
        built.parallel.on_failure(lambda reason: loop.fail(f"tensor parallel worker failed: {reason}"))
    outputs.send(msgpack.packb(["ready", ready_info(built)]))
    log.info("engine core %d ready", os.getpid())
    try:
        return loop.run()
    finally:
        if built.parallel is not None:
            built.parallel.stop()
        context.destroy(linger=2000)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)   # no waiting on helper threads (grammar masks, tensor-parallel heartbeat)
