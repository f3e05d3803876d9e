"""Postgres goes away under the conversations service, and comes back.

A throwaway cluster of our own (initdb into a temp dir, a free port; never the machine's shared
server on 5432) backs a real conversations process, with a gateway (the real app over the scripted
upstream) in front. While Postgres is down: chat without a conversation keeps working; reads and
writes of conversations fail at once with a clear error (no hang, nothing reported as stored); the
service stays up. When Postgres returns, the writes retried with the same idempotency key are stored
exactly once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from llmserve.v1 import conversations_pb2 as pb
from llmserve.v1 import conversations_pb2_grpc
from tests.gateway.harness import GatewayHarness, gateway_config
from tests.procs import free_port
from tests.reliability.platform import grpc_proc

ORG = "org-pg-outage"
CALL_TIMEOUT_S = 10


class OwnPostgres:
    """A PostgreSQL cluster in a temp dir on a free loopback port, run as the postgres user when we are root."""

    def __init__(self):
        self.initdb, self.pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
        assert self.initdb and self.pg_ctl, "initdb/pg_ctl not found: the Postgres outage test needs its own cluster"
        # Not under pytest's tmp_path: its 0700 parents keep the postgres user out.
        self.dir, self.port = Path(tempfile.mkdtemp(prefix="llmserve-pg-")), free_port()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        self._run(f"{self.initdb} -D {self.dir}/data -A trust -U postgres --no-sync")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, command: str) -> None:
        argv = ["su", "postgres", "-c", command] if os.geteuid() == 0 else ["sh", "-c", command]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"

    def start(self) -> None:
        self._run(f"{self.pg_ctl} -D {self.dir}/data -l {self.dir}/log -w -t 30 start "
                  f"-o '-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off'")

    def stop(self) -> None:
        self._run(f"{self.pg_ctl} -D {self.dir}/data -m immediate -w stop")


@pytest.fixture
def own_postgres():
    pg = OwnPostgres()
    try:
        pg.start()
        yield pg
        pg.stop()
    finally:
        shutil.rmtree(pg.dir, ignore_errors=True)


def append(stub, conversation_id: str, key: str, text: str):
    return stub.AppendMessages(pb.AppendMessagesRequest(
        organization_id=ORG, conversation_id=conversation_id, idempotency_key=key,
        messages=[pb.NewMessage(role="user", content=text), pb.NewMessage(role="assistant", content="ok")]),
        timeout=CALL_TIMEOUT_S)


def test_postgres_outage_is_reported_and_retries_store_once(own_postgres, tmp_path):
    port = free_port()
    conversations = grpc_proc("conversations-pg", "services.conversations", {
        "LLMSERVE_CONVERSATIONS__SERVER__PORT": str(port), "LLMSERVE_CONVERSATIONS__SERVER__METRICS_PORT": "0",
        "LLMSERVE_CONVERSATIONS__STORE__URL": own_postgres.url}, port, tmp_path).start()
    try:
        conversations.wait_ready(120)
        cfg = gateway_config(f"sqlite:///{tmp_path / 'g.db'}", conversations.address)
        with grpc.insecure_channel(conversations.address) as channel, GatewayHarness(cfg) as gw:
            stub = conversations_pb2_grpc.ConversationsStub(channel)
            cid = stub.CreateConversation(pb.CreateConversationRequest(organization_id=ORG, title="t"),
                                          timeout=CALL_TIMEOUT_S).id
            append(stub, cid, "turn-1", "first")
            secret = gw.new_org("pg")[2]
            headers = {"Authorization": f"Bearer {secret}"}
            chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}

            own_postgres.stop()
            started = time.monotonic()
            for call in (lambda: stub.GetConversation(pb.GetConversationRequest(organization_id=ORG, conversation_id=cid),
                                                      timeout=CALL_TIMEOUT_S),
                         lambda: append(stub, cid, "turn-2", "second")):
                with pytest.raises(grpc.RpcError) as failed:
                    call()
                assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
                assert failed.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 2 * CALL_TIMEOUT_S
            assert conversations.alive()
            # Chat without a conversation does not need Postgres; with one it fails clearly.
            assert gw.http.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200
            resumed = gw.http.post("/v1/chat/completions", json={**chat, "conversation_id": cid}, headers=headers)
            assert resumed.status_code in (502, 503) and resumed.json()["error"]["message"], resumed.text
            assert own_postgres.url.split("@")[0] not in resumed.text      # no connection details leak

            own_postgres.start()
            deadline, stored = time.monotonic() + 30, None
            while stored is None:   # the pool reconnects; the caller retries its write with the same key
                try:
                    stored = append(stub, cid, "turn-2", "second")
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the store never came back"
                    time.sleep(0.5)
            again = append(stub, cid, "turn-2", "second")
            assert [m.id for m in again.messages] == [m.id for m in stored.messages]
            conversation = stub.GetConversation(pb.GetConversationRequest(organization_id=ORG, conversation_id=cid),
                                                timeout=CALL_TIMEOUT_S)
            assert [m.content for m in conversation.messages] == ["first", "ok", "second", "ok"]   # once each
    finally:
        conversations.stop()
    assert "failed" in conversations.log()   # the outage is in the service's log
