"""The admin API and the SRE CLI over it: organizations, keys (secret shown once, hash stored),
revocation, usage per key and model, the router's workers."""

from __future__ import annotations

import hashlib
import json

import pytest

from services.gateway import cli
from tests.gateway.harness import ADMIN_TOKEN, GatewayHarness


def run_cli(gateway: GatewayHarness, capsys, *args: str):
    cli.main(["--url", gateway.base_url, "--token", ADMIN_TOKEN, *args])
    return json.loads(capsys.readouterr().out)


def test_cli_creates_org_and_key_and_reads_usage(gateway: GatewayHarness, capsys):
    org = run_cli(gateway, capsys, "orgs", "create", "cli-org", "--rpm", "100", "--tpm", "50000")
    assert (org["name"], org["rpm_limit"], org["tpm_limit"]) == ("cli-org", 100, 50000)
    assert org["id"] in [o["id"] for o in run_cli(gateway, capsys, "orgs", "list")["data"]]
    key = run_cli(gateway, capsys, "keys", "create", org["id"], "ci", "--rpm", "7")
    secret = key["key"]
    assert secret.startswith("sk-") and key["rpm_limit"] == 7 and "key_hash" not in key
    listed = run_cli(gateway, capsys, "keys", "list", org["id"])["data"]
    assert [k["id"] for k in listed] == [key["id"]] and all("key" not in k for k in listed)

    stored = gateway.call(gateway.gateway.store.find_key(hashlib.sha256(secret.encode()).hexdigest()))
    assert stored.id == key["id"]                                   # found by hash; the secret is not stored
    for model, n in (("fake-model", 2), ("tiny-model", 1)):
        for _ in range(n):
            reply = gateway.http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                                      json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                            "max_completion_tokens": 8})
            assert reply.status_code == 200, reply.text
    gateway.drain()
    usage = run_cli(gateway, capsys, "usage", org["id"])["data"]
    assert [(u["key_id"], u["model"], u["requests"], u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"])
            for u in usage] == [(key["id"], "fake-model", 2, 8, 6, 4), (key["id"], "tiny-model", 1, 4, 3, 2)]
    records = gateway.call(gateway.gateway.store.list_usage(org["id"]))
    assert {r.status for r in records} == {"ok"} and all(r.latency_ms >= 0 for r in records)

    assert run_cli(gateway, capsys, "keys", "revoke", key["id"])["revoked"] is True
    with pytest.raises(SystemExit, match="error 404"):
        run_cli(gateway, capsys, "keys", "revoke", key["id"])


def test_cli_reports_bad_token_and_unreachable_gateway(gateway: GatewayHarness):
    with pytest.raises(SystemExit, match="error 403"):
        cli.main(["--url", gateway.base_url, "--token", "wrong", "orgs", "list"])
    with pytest.raises(SystemExit, match="cannot reach"):
        cli.main(["--url", "http://127.0.0.1:1", "--token", ADMIN_TOKEN, "orgs", "list"])
    with pytest.raises(SystemExit, match="no admin token"):
        cli.main(["--url", gateway.base_url, "--token", "", "orgs", "list"])


def test_workers_are_proxied_from_the_router(gateway: GatewayHarness, capsys):
    workers = run_cli(gateway, capsys, "workers")["data"]
    assert workers[0]["address"] == "127.0.0.1:1" and workers[0]["model"] == "fake-model"
    assert workers[0]["healthy"] is True


def test_get_organization_lists_keys_without_secrets(gateway: GatewayHarness):
    org_id, key_id, _ = gateway.new_org("detail")
    body = gateway.admin("GET", f"/admin/v1/organizations/{org_id}").json()
    assert [k["id"] for k in body["keys"]] == [key_id] and "key_hash" not in body["keys"][0]
    assert gateway.admin("GET", "/admin/v1/organizations/org_nope").status_code == 404
    assert gateway.admin("GET", f"/admin/v1/organizations/{org_id}/usage?since=abc").status_code == 400
