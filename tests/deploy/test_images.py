"""The service images, built here and run as the Helm charts run them (`make test-images`).

Each image: the chart's non-root user, its OCI labels, no build tools and nothing of the build
(certificates, wheel links) left in it, every module of its service importable on a read-only root
filesystem, its code not writable by that user. Then the platform from the images (conversations,
a CPU worker with SmolLM2, router, gateway, each pod as its chart renders it: user, read-only root,
mounts, config, secrets, probes) and the end-to-end smoke through the openai SDK: models listed,
a streamed chat, a conversation resumed, health and metrics answered, and a clean stop: every
service exits 0 on SIGTERM within its grace period.

Needs a Docker engine (or root to start one) and debootstrap: slow, so outside `make test`.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request

import httpx
import openai
import pytest
import yaml

from deploy.docker import build as docker_build
from tests.deploy.charts import CHARTS_DIR
from tests.deploy.images import IMAGES, MODEL, PORTS, START_ORDER, probe, running_platform, stop
from tests.deploy.service_imports import needing_triton

# Slow, and a cold build (make images) alone can take 10 minutes here, past the suite default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SERVICES = ("gateway", "router", "conversations", "worker")
# Modules the CPU worker image cannot import on purpose: the Triton kernels (CUDA workers only).
NOT_IN_IMAGE = {"worker": needing_triton("worker")}
BUILD_TOOLS = ("gcc", "cc", "c++", "make", "pip", "pip3")
NAME = "Zorblax"   # a name the model cannot know unless the first turn is in its prompt


@pytest.fixture(scope="module")
def docker():
    with docker_build.engine() as engine:
        docker_build.build(engine)   # the layer cache makes unchanged images a no-op
        yield engine


def chart_security(service: str) -> dict:
    values = yaml.safe_load((CHARTS_DIR / service / "values.yaml").read_text())
    return {**values["podSecurityContext"], **values["securityContext"]}


def image_config(docker, service: str) -> dict:
    return json.loads(docker.docker("image", "inspect", IMAGES[service].ref).stdout)[0]["Config"]


def run_in_image(docker, service: str, options: list[str], *command: str) -> subprocess.CompletedProcess:
    """A command in the service's image as the chart's user, with no network."""
    user = chart_security(service)
    return docker.docker("run", "--rm", "--network", "none", "--user", f"{user['runAsUser']}:{user['runAsGroup']}",
                         *options, "--entrypoint", command[0], IMAGES[service].ref, *command[1:], check=False)


@pytest.mark.parametrize("service", SERVICES)
def test_image_runs_as_the_charts_non_root_user_and_is_labelled(docker, service):
    config = image_config(docker, service)
    uid, _, gid = config["User"].partition(":")
    security = chart_security(service)
    assert uid.isdigit() and int(uid) != 0, f"{service} image runs as {config['User']!r}"
    assert (int(uid), int(gid)) == (security["runAsUser"], security["runAsGroup"])
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == docker_build.version()
    assert labels["org.opencontainers.image.source"] and labels["org.opencontainers.image.revision"]
    assert config["Entrypoint"] == ["python", "-m", f"services.{service}"]


IMPORT_EVERY_MODULE = """
import importlib, json, os, pkgutil, sys
skip = set(sys.argv[2:])
package = importlib.import_module(sys.argv[1])
failed, imported = {}, 0
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if module.name in skip:
        continue
    try:
        importlib.import_module(module.name)
        imported += 1
    except Exception as e:
        failed[module.name] = f"{type(e).__name__}: {e}"
try:
    open("/app/written", "w")
    root = "writable"
except OSError as e:
    root = e.strerror
writable = [d for d in ("/app", "/app/services", "/app/libs/llmserve", "/opt/venv", "/opt/venv/lib", "/etc", "/")
            if os.access(d, os.W_OK)]
open("/tmp/written", "w").write("ok")
print(json.dumps({"imported": imported, "failed": failed, "root": root, "writable": writable}))
"""


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_module_imports_on_a_read_only_root(docker, service):
    """A file the image forgot (a module, a generated stub, a package) fails the import here."""
    result = run_in_image(docker, service, ["--read-only", "--mount", "type=tmpfs,target=/tmp"],
                          "python", "-c", IMPORT_EVERY_MODULE, f"services.{service}", *sorted(NOT_IN_IMAGE.get(service, ())))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == {} and report["imported"] > 3
    assert report["root"] == "Read-only file system"
    assert report["writable"] == [], f"the service's user may write {report['writable']}"


@pytest.mark.parametrize("service", SERVICES)
def test_no_build_tools_and_nothing_of_the_build_in_the_image(docker, service):
    found = run_in_image(docker, service, [], "sh", "-c", " ; ".join(f"command -v {tool}" for tool in BUILD_TOOLS)
                         + " ; ls -d /src /opt/protoc 2>/dev/null").stdout.split()
    assert found == [], f"{service} image has {found}"
    history = docker.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGES[service].ref).stdout
    for leaked in ("EXTRA_CA_CERTS", "PIP_FIND_LINKS", "BEGIN CERTIFICATE", "ca.pem"):
        assert leaked not in history
    names = [entry.partition("=")[0] for entry in image_config(docker, service)["Env"]]
    assert not [n for n in names if any(word in n for word in ("TOKEN", "PASSWORD", "SECRET", "_KEY", "URL"))]


# The platform from the images.

@pytest.fixture(scope="module")
def platform(docker, tmp_path_factory):
    with running_platform(docker, tmp_path_factory.mktemp("images")) as running:
        yield running


@pytest.fixture(scope="module")
def api_key(platform) -> str:
    admin = {"Authorization": f"Bearer {platform.admin_token}"}
    with httpx.Client(base_url=platform.gateway, headers=admin, timeout=30) as http:
        org = http.post("/admin/v1/organizations", json={"name": "images"})
        assert org.status_code == 201, org.text
        key = http.post(f"/admin/v1/organizations/{org.json()['id']}/keys", json={"name": "smoke"})
        assert key.status_code == 201, key.text
        return key.json()["key"]


@pytest.fixture
def client(platform, api_key):
    with openai.OpenAI(base_url=f"{platform.gateway}/v1", api_key=api_key, max_retries=0, timeout=120) as c:
        yield c


def test_pods_run_as_their_charts_say(platform):
    for service in START_ORDER:
        state = platform.inspect(service)
        security = chart_security(service)
        assert state["Config"]["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
        host = state["HostConfig"]
        assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"]
        assert "no-new-privileges" in host["SecurityOpt"]
        assert {m["Target"] for m in host["Mounts"]} >= {"/tmp", f"/etc/llmserve/{service}.yaml"}
        whoami = platform.docker.docker("exec", platform.pods[service].name, "id", "-u").stdout.strip()
        assert whoami == str(security["runAsUser"])


def test_models_are_listed(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_streamed_chat(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a poem about the sea."}],
        max_completion_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert deltas[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in deltas if c.choices and c.choices[0].delta.content) >= 2
    assert deltas[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in deltas).strip()


def test_conversation_is_resumed(platform, api_key, client):
    with httpx.Client(base_url=platform.gateway, headers={"Authorization": f"Bearer {api_key}"}, timeout=60) as http:
        created = http.post("/v1/conversations", json={"title": "images", "model": MODEL})
        assert created.status_code == 201, created.text
        conversation = created.json()["id"]

        def ask(text: str):
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_completion_tokens=12,
                temperature=0, extra_body={"conversation_id": conversation})

        first = ask(f"My name is {NAME}. Please remember it.")
        second = ask("What is my name?")
        assert NAME in second.choices[0].message.content
        assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
        stored = http.get(f"/v1/conversations/{conversation}").json()
        assert stored["message_count"] == 4
        assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "user", "assistant"]


def test_health_metrics_and_the_chat_page_answer(platform):
    for service in START_ORDER:
        spec = platform.pods[service]
        assert probe(spec.probes["liveness"], spec.ports) and probe(spec.probes["readiness"], spec.ports)
    # A labelled sample of each: the chats above were counted (the worker's gauge always has one).
    counted = {"gateway": "llmserve_gateway_requests_total{", "router": "llmserve_router_requests_total{",
               "worker": "vllm:num_requests_running{", "conversations": "llmserve_conversations_requests_total{"}
    for service, sample in counted.items():
        port = PORTS["gateway"] if service == "gateway" else PORTS[f"{service}_metrics"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200 and sample in reply.read().decode(), service
    with httpx.Client(base_url=platform.gateway, timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert http.get("/openapi.json").json()["openapi"].startswith("3.")


def test_every_service_stops_cleanly_on_sigterm(platform):
    """Gateway first, so nothing new reaches a stopping service; each exits 0 (SIGTERM handled, as
    PID 1 with no init) before its grace period ends the kubelet's way, with SIGKILL (137)."""
    for service in reversed(START_ORDER):
        state = stop(platform, service)
        assert (state["ExitCode"], state["OOMKilled"]) == (0, False), f"{service}:\n{platform.logs(service)}"
        assert "Traceback" not in platform.logs(service), platform.logs(service)
