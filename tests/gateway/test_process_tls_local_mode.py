"""`python -m services.gateway` as deployed: HTTPS from the configured certificate, local mode's
dev organization, key and admin token; and the configuration checks that refuse to start."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llmserve.config import ConfigError
from services.gateway.config import GatewayConfig, apply_local_environment, validate
from tests.procs import REPO, free_port, stop_process_group


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    done = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, text=True)
    assert done.returncode == 0, f"openssl could not make a test certificate: {done.stderr}"
    return cert, key


def test_https_process_in_local_mode(tmp_path: Path, conversations_address: str):
    cert, key = self_signed(tmp_path)
    port = free_port()
    env = {**os.environ, "LLMSERVE_GATEWAY__SERVER__PORT": str(port),
           "LLMSERVE_GATEWAY__SERVER__TLS_CERT_FILE": str(cert), "LLMSERVE_GATEWAY__SERVER__TLS_KEY_FILE": str(key),
           "LLMSERVE_GATEWAY__DATABASE__URL": f"sqlite:///{tmp_path / 'g.db'}",
           "LLMSERVE_GATEWAY__CONVERSATIONS__ADDRESS": conversations_address,
           "LLMSERVE_GATEWAY__LOCAL_MODE__ENABLED": "true",
           "LLMSERVE_DEV_API_KEY": "sk-test-dev", "LLMSERVE_ADMIN_TOKEN": "admin-test"}
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "services.gateway"], cwd=REPO, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(cert)), timeout=5) as https:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    health = https.get("/healthz")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.2)
            assert health.status_code == 200 and health.headers["x-request-id"]
            orgs = https.get("/admin/v1/organizations", headers={"Authorization": "Bearer admin-test"})
            assert [o["name"] for o in orgs.json()["data"]] == ["dev"]
            listed = https.get("/v1/conversations", headers={"Authorization": "Bearer sk-test-dev"})
            assert listed.status_code == 200 and listed.json()["object"] == "list"
            assert https.get("/v1/conversations", headers={"Authorization": "Bearer sk-local-dev"}).status_code == 401
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).raise_for_status()  # no plain HTTP here
    finally:
        stop_process_group(process)


def test_plain_http_must_be_asked_for():
    with pytest.raises(ConfigError, match="plain_http"):
        validate(GatewayConfig())
    cfg = GatewayConfig()
    cfg.server.tls_cert_file = "cert.pem"
    with pytest.raises(ConfigError, match="go together"):
        validate(cfg)
    cfg = GatewayConfig()
    cfg.server.plain_http = True
    cfg.overload.refuse_status = 500
    with pytest.raises(ConfigError, match="refuse_status"):
        validate(cfg)


def test_local_mode_defaults_and_environment():
    cfg = GatewayConfig()
    assert apply_local_environment(cfg, {"LLMSERVE_ADMIN_TOKEN": "x"}).auth.admin_token == ""  # not local: ignored
    cfg.local_mode.enabled = True
    apply_local_environment(cfg, {})
    assert (cfg.local_mode.api_key, cfg.auth.admin_token) == ("sk-local-dev", "admin-local-dev")
    cfg = GatewayConfig()
    cfg.local_mode.enabled = True
    apply_local_environment(cfg, {"LLMSERVE_DEV_API_KEY": "sk-a", "LLMSERVE_ADMIN_TOKEN": "adm"})
    assert (cfg.local_mode.api_key, cfg.auth.admin_token) == ("sk-a", "adm")
    defaults = GatewayConfig()
    assert (defaults.server.host, defaults.server.port, defaults.upstream.address, defaults.conversations.address,
            defaults.database.url, defaults.rate_limit.backend) == (
        "127.0.0.1", 8080, "127.0.0.1:50050", "127.0.0.1:50060", "sqlite:///var/gateway.db", "memory")
