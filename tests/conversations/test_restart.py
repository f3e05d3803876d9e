"""The real server as a process, configured through the environment: a SIGKILL loses nothing that
was acknowledged, health and metrics are served, and SIGTERM shuts down cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmserve.v1 import conversations_pb2 as pb
from llmserve.v1 import conversations_pb2_grpc

from .harness import REPO, ServerProcess


def write_history(stub) -> dict[tuple[str, str], pb.Conversation]:
    """Two organizations, a few conversations each, several appends: returns what Get shows."""
    written = {}
    for org in ("org-a", "org-b"):
        for n in range(3):
            conversation = stub.CreateConversation(pb.CreateConversationRequest(
                organization_id=org, title=f"{org} chat {n}", model="smollm2-135m-instruct", metadata={"n": str(n)}))
            for turn in range(n + 1):
                stub.AppendMessages(pb.AppendMessagesRequest(
                    organization_id=org, conversation_id=conversation.id, idempotency_key=f"turn-{turn}",
                    messages=[pb.NewMessage(role="user", content=f"question {turn}"),
                              pb.NewMessage(role="assistant", content=f"answer {turn}", model="smollm2-135m-instruct",
                                            partial=turn == n)]))
            written[org, conversation.id] = stub.GetConversation(
                pb.GetConversationRequest(organization_id=org, conversation_id=conversation.id))
    return written


def test_sigkill_and_restart_lose_nothing(store_url, tmp_path):
    log = tmp_path / "server.log"
    first = ServerProcess.start(store_url, log)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            written = write_history(conversations_pb2_grpc.ConversationsStub(channel))
    finally:
        first.kill()   # SIGKILL: no shutdown hook runs

    second = ServerProcess.start(store_url, log)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{second.port}") as channel:
            stub = conversations_pb2_grpc.ConversationsStub(channel)
            for (org, conversation_id), before in written.items():
                after = stub.GetConversation(pb.GetConversationRequest(organization_id=org, conversation_id=conversation_id))
                assert after == before
            for org in ("org-a", "org-b"):
                listed = stub.ListConversations(pb.ListConversationsRequest(organization_id=org)).conversations
                assert {c.id for c in listed} >= {cid for o, cid in written if o == org}
            # A retry of an append acknowledged before the crash is still recognised.
            org, conversation_id = next(iter(written))
            retried = stub.AppendMessages(pb.AppendMessagesRequest(
                organization_id=org, conversation_id=conversation_id, idempotency_key="turn-0",
                messages=[pb.NewMessage(role="user", content="question 0")]))
            assert [m.id for m in retried.messages] == [m.id for m in written[org, conversation_id].messages[:2]]

            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{second.metrics_port}/metrics", timeout=10).read().decode()
        assert 'llmserve_conversations_requests_total{code="OK",method="GetConversation"} 6.0' in metrics
        assert 'llmserve_conversations_store_seconds_count{operation="append"} 1.0' in metrics
    finally:
        exit_code = second.terminate()
    assert exit_code == 0, log.read_text()[-3000:]
    assert "conversations stopped" in log.read_text()


@pytest.mark.parametrize("url, words", [
    ("postgresql://postgres@127.0.0.1:1/none", "cannot open the store postgresql://postgres@127.0.0.1:1/none"),
    ("mysql://db/x", "store url must be sqlite:///path or postgresql://"),
])
def test_unusable_store_exits_with_a_clear_error(url, words):
    env = dict(os.environ, LLMSERVE_CONVERSATIONS__STORE__URL=url, LLMSERVE_CONVERSATIONS__SERVER__PORT="0",
               LLMSERVE_CONVERSATIONS__SERVER__METRICS_PORT="0")
    result = subprocess.run([sys.executable, "-m", "services.conversations"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and words in result.stderr
    assert "Traceback" not in result.stderr
