"""Admin CLI for SREs, over the gateway's admin API.

    python -m services.gateway.cli orgs create acme --rpm 600 --tpm 100000 [--weight 2]
    python -m services.gateway.cli orgs list
    python -m services.gateway.cli orgs weight <org id> 2        # its fair share of a contended model
    python -m services.gateway.cli keys create <org id> ci-key [--rpm N] [--tpm N] [--priority batch]
                                                                  # prints the secret once
    python -m services.gateway.cli keys list <org id>
    python -m services.gateway.cli keys revoke <key id>
    python -m services.gateway.cli usage <org id> [--since UNIX_SECONDS]
    python -m services.gateway.cli workers [--model NAME]

The gateway URL and admin token come from --url/--token or LLMSERVE_GATEWAY_URL/LLMSERVE_ADMIN_TOKEN.
Output is the API's JSON; errors print the API's message and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class AdminClient:
    def __init__(self, url: str, token: str, insecure: bool = False, timeout_s: float = 10.0):
        self._url = url.rstrip("/")
        self._token = token
        self._timeout = timeout_s
        self._ssl = ssl._create_unverified_context() if insecure else None

    def call(self, method: str, path: str, body: dict | None = None, query: dict | None = None) -> Any:
        url = self._url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self._token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout, context=self._ssl) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = e.reason
            raise SystemExit(f"error {e.code}: {message}") from None
        except urllib.error.URLError as e:
            raise SystemExit(f"cannot reach the gateway at {self._url}: {e.reason}") from None


def _limits(args: argparse.Namespace) -> dict:
    return {k: v for k, v in (("rpm_limit", args.rpm), ("tpm_limit", args.tpm)) if v is not None}


def run(args: argparse.Namespace, client: AdminClient) -> Any:
    if args.group == "orgs" and args.action == "create":
        extra = {"weight": args.weight} if args.weight is not None else {}
        return client.call("POST", "/admin/v1/organizations", {"name": args.name, **_limits(args), **extra})
    if args.group == "orgs" and args.action == "weight":
        return client.call("PATCH", f"/admin/v1/organizations/{args.org}", {"weight": args.weight})
    if args.group == "orgs":
        return client.call("GET", "/admin/v1/organizations")
    if args.group == "keys" and args.action == "create":
        return client.call("POST", f"/admin/v1/organizations/{args.org}/keys",
                           {"name": args.name, "priority_class": args.priority, **_limits(args)})
    if args.group == "keys" and args.action == "list":
        return client.call("GET", f"/admin/v1/organizations/{args.org}/keys")
    if args.group == "keys":
        return client.call("DELETE", f"/admin/v1/keys/{args.key}")
    if args.group == "usage":
        return client.call("GET", f"/admin/v1/organizations/{args.org}/usage", query={"since": args.since})
    return client.call("GET", "/admin/v1/workers", query={"model": args.model} if args.model else None)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway.cli", description="llmserve gateway admin")
    p.add_argument("--url", default=os.environ.get("LLMSERVE_GATEWAY_URL", "http://127.0.0.1:8080"))
    p.add_argument("--token", default=os.environ.get("LLMSERVE_ADMIN_TOKEN", ""))
    p.add_argument("--insecure", action="store_true", help="do not verify the gateway's TLS certificate")
    groups = p.add_subparsers(dest="group", required=True)

    orgs = groups.add_parser("orgs").add_subparsers(dest="action", required=True)
    create = orgs.add_parser("create")
    create.add_argument("name")
    create.add_argument("--weight", type=float, help="fair share against other organizations (default 1)")
    orgs.add_parser("list")
    weight = orgs.add_parser("weight")
    weight.add_argument("org")
    weight.add_argument("weight", type=float)

    keys = groups.add_parser("keys").add_subparsers(dest="action", required=True)
    create_key = keys.add_parser("create")
    create_key.add_argument("org")
    create_key.add_argument("name")
    create_key.add_argument("--priority", default="interactive", choices=["interactive", "batch"],
                            help="interactive requests go before batch ones when a model is contended")
    keys.add_parser("list").add_argument("org")
    keys.add_parser("revoke").add_argument("key")
    for sub in (create, create_key):
        sub.add_argument("--rpm", type=int, help="requests per minute (0 = unlimited)")
        sub.add_argument("--tpm", type=int, help="tokens per minute (0 = unlimited)")

    usage = groups.add_parser("usage")
    usage.add_argument("org")
    usage.add_argument("--since", type=int, default=0, help="unix time in seconds")
    groups.add_parser("workers").add_argument("--model", default="")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.token:
        raise SystemExit("no admin token: pass --token or set LLMSERVE_ADMIN_TOKEN")
    result = run(args, AdminClient(args.url, args.token, args.insecure))
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
