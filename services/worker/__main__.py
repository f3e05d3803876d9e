"""python -m services.worker [--config worker.yaml]: one engine, one model, one gRPC server.

By default the engine core runs in a child process (engine/core_process.py) and this process is
its front end: gRPC, tokenizing, detokenizing, stop strings. If the core dies, the streams end
with UNAVAILABLE, health turns NOT_SERVING and the worker exits non-zero after a short drain, for
its supervisor (Kubernetes) to restart it. engine.engine_process false keeps the engine on a
thread of this process.
"""

from __future__ import annotations

from services.worker.openmp import set_wait_policy

set_wait_policy()   # before torch loads OpenMP

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmserve.config import load_config
from llmserve.metrics_http import MetricsServer
from llmserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.engine.core_protocol import EngineDead
from services.worker.metrics import WorkerMetrics
from services.worker.server import GenerationServicer, ServedModel

log = logging.getLogger("llmserve.worker")
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.max_send_message_length", 64 * 2**20)]
ENGINE_DEAD_DRAIN_S = 3.0   # NOT_SERVING this long after the engine died, so routers see it, then exit


class StartedEngine:
    """The servicer's engine client, what the front end serves with, and how to stop it."""

    def __init__(self, client, tokenizer, model: ServedModel, stop, parallel=None) -> None:
        self.client, self.tokenizer, self.model, self.stop, self.parallel = client, tokenizer, model, stop, parallel


async def start_engine(cfg: WorkerConfig, failed) -> StartedEngine:
    """failed(reason), from any thread, when the engine cannot go on (it ended the streams)."""
    if cfg.engine.engine_process:
        from services.worker.engine.core_client import EngineCoreClient
        client = EngineCoreClient(cfg, on_dead=failed)
        try:
            await client.start()
        except RuntimeError as e:
            await client.stop()
            raise SystemExit(f"worker exits: {e}") from None
        model = ServedModel(cfg.model.name, client.limits.max_model_len, client.dtype, client.vocab_size,
                            tool_call_format=client.tokenizer.tool_call_format)
        return StartedEngine(client, client.tokenizer, model, client.stop)
    # In process: model code and weights load here (the front end alone need not import them).
    from services.worker.engine.async_engine import AsyncEngine
    from services.worker.engine.build import build_engine
    built = build_engine(cfg.model, cfg.engine)
    engine = built.engine
    model = ServedModel(cfg.model.name, engine.limits.max_model_len, built.dtype_name,
                        built.loaded.config.vocab_size,
                        tool_call_format=built.loaded.tokenizer.tool_call_format)
    engine.grammars.warm_up()   # before serving: it holds the GIL for a moment
    if cfg.engine.warm_up:
        from services.worker.engine.warm_up import warm_up
        log.info("engine warmed up in %.1f s", warm_up(engine.core))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    if built.parallel is not None:   # a rank died: the engine cannot step, so the worker goes
        loop = asyncio.get_running_loop()

        def rank_failed(reason: str) -> None:
            error = EngineDead(f"tensor parallel worker failed: {reason}")
            loop.call_soon_threadsafe(async_engine.fail_streams, error)
            failed(str(error))
        built.parallel.on_failure(rank_failed)

    async def stop() -> None:
        async_engine.stop()
        if built.parallel is not None:
            built.parallel.stop()
    return StartedEngine(async_engine, built.loaded.tokenizer, model, stop, built.parallel)


async def serve(cfg: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    failure: list[str] = []   # why the engine cannot go on, once it cannot

    def engine_failed(reason: str) -> None:
        failure.append(reason)
        loop.call_soon_threadsafe(stop.set)

    # Before anything can be served: a SIGTERM once the first stream runs must drain it, not kill it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started = await start_engine(cfg, engine_failed)
    engine, model = started.client, started.model
    metrics = WorkerMetrics(model.name, lambda: engine.stats)

    server = grpc.aio.server(options=GRPC_OPTIONS)
    address = f"{cfg.server.host}:{cfg.server.port}"
    port = server.add_insecure_port(address)
    name = cfg.server.name or f"{cfg.server.host}:{port}"
    servicer = GenerationServicer(engine, started.tokenizer, model, name, metrics)
    worker_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = (worker_pb2.DESCRIPTOR.services_by_name["Generation"].full_name, health.SERVICE_NAME,
                     reflection.SERVICE_NAME)
    reflection.enable_server_reflection(service_names, server)
    await server.start()
    for service in ("", service_names[0]):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    metrics_server = MetricsServer(metrics.registry)
    metrics_server.serve(cfg.server.host, cfg.server.metrics_port)
    log.info("worker %s serving model %s on %s:%d (metrics :%d)", name, model.name, cfg.server.host, port,
             cfg.server.metrics_port)
    print(f"worker ready on {cfg.server.host}:{port}", flush=True)
    if cfg.server.register_with:
        await _register(cfg, port, model.name)

    await stop.wait()
    # Drain: report NOT_SERVING so routers stop sending, let running requests finish. A dead
    # engine has ended its streams already: stay NOT_SERVING a moment for the routers, then go.
    servicer.draining = True
    await health_servicer.enter_graceful_shutdown()
    if failure:
        log.error("the engine failed (%s): NOT_SERVING for %.1fs, then exiting", failure[0], ENGINE_DEAD_DRAIN_S)
        await asyncio.sleep(ENGINE_DEAD_DRAIN_S)
        await server.stop(0)
    else:
        log.info("draining for up to %.1fs", cfg.server.grace_period_s)
        await server.stop(cfg.server.grace_period_s)
    await started.stop()
    metrics_server.close()
    if failure:
        raise SystemExit(f"worker {name} exits: {failure[0]}")


async def _register(cfg: WorkerConfig, port: int, model: str) -> None:
    advertise = cfg.server.advertise_address or f"{cfg.server.host}:{port}"
    try:
        async with grpc.aio.insecure_channel(cfg.server.register_with) as channel:
            await router_pb2_grpc.RouterStub(channel).RegisterWorker(
                router_pb2.RegisterWorkerRequest(address=advertise, model=model), timeout=5)
        log.info("registered %s with router %s", advertise, cfg.server.register_with)
    except grpc.RpcError as e:
        log.warning("could not register with router %s: %s", cfg.server.register_with, e.details())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML file; LLMSERVE_WORKER__SECTION__KEY variables override it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(WorkerConfig, args.config, "LLMSERVE_WORKER")
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
