"""Helpers for the conversations tests: test configuration and the server as a real process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.conversations.config import ConversationsConfig, LimitsConfig, ServerConfig, StoreConfig

REPO = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING

# Small limits keep the bad-input payloads small; the boundaries are what the tests probe.
TEST_LIMITS = LimitsConfig(max_content_bytes=1000, max_messages_per_append=5, max_title_chars=50,
                           max_metadata_entries=3, max_metadata_bytes=100, max_id_chars=40,
                           default_page_size=4, max_page_size=100)


def config_for(store_url: str) -> ConversationsConfig:
    return ConversationsConfig(server=ServerConfig(port=0, metrics_port=0, grace_period_s=1.0),
                               store=StoreConfig(url=store_url, pool_max_size=12), limits=TEST_LIMITS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`python -m services.conversations` configured through the environment, as deployed."""
    process: subprocess.Popen
    port: int
    metrics_port: int

    @classmethod
    def start(cls, store_url: str, log_path: Path, timeout_s: float = 60.0, tries: int = 3) -> ServerProcess:
        """A port picked free may be taken before the server binds it (another test's outgoing
        connection gets it from the same ephemeral range): a start that fails so is tried again
        on other ports."""
        for _ in range(tries):
            port, metrics_port = free_port(), free_port()
            env = dict(os.environ,
                       LLMSERVE_CONVERSATIONS__SERVER__PORT=str(port),
                       LLMSERVE_CONVERSATIONS__SERVER__METRICS_PORT=str(metrics_port),
                       LLMSERVE_CONVERSATIONS__SERVER__GRACE_PERIOD_S="2",
                       LLMSERVE_CONVERSATIONS__STORE__URL=store_url)
            logged = log_path.stat().st_size if log_path.exists() else 0
            with open(log_path, "ab") as log:
                process = subprocess.Popen([sys.executable, "-m", "services.conversations"], cwd=REPO, env=env,
                                           stdout=log, stderr=subprocess.STDOUT)
            server = cls(process, port, metrics_port)
            if server.wait_serving(timeout_s):
                return server
            server.kill()
            if b"Address already in use" not in log_path.read_bytes()[logged:]:
                break
        pytest.fail(f"conversations server did not become healthy:\n{log_path.read_text()[-3000:]}", pytrace=False)

    def wait_serving(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        request = health_pb2.HealthCheckRequest(service="llmserve.v1.Conversations")
        while time.monotonic() < deadline and self.process.poll() is None:
            # A fresh channel each try: one that failed before the server listened backs off for seconds.
            with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                try:
                    if health_pb2_grpc.HealthStub(channel).Check(request, timeout=1).status == SERVING:
                        return True
                except grpc.RpcError:
                    pass
            time.sleep(0.1)
        return False

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def terminate(self, timeout_s: float = 15.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)
