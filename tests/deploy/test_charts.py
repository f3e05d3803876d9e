"""Every chart, with every value set: renders, passes strict lint, and every manifest validates
strictly against the Kubernetes API schemas; then what the manifests must say."""

from __future__ import annotations

import base64
import json
import shutil

import helm_python as helm
import pytest
import yaml

from deploy.k8s import values_schema
from llmserve.config import load_config
from services.conversations.config import ConversationsConfig
from services.gateway.config import GatewayConfig, validate as validate_gateway
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from tests.deploy.charts import (CHARTS_DIR, SERVICE_CHARTS, UMBRELLA, build_charts, lint_findings, render,
                                 schema_errors)
from tests.deploy.values import CHART_SECRETS, PRODUCTION, VALUE_SETS, values_for

CONFIG_CLASSES = {"gateway": GatewayConfig, "router": RouterConfig, "worker": WorkerConfig,
                  "conversations": ConversationsConfig}
RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                      "app.kubernetes.io/component", "app.kubernetes.io/part-of",
                      "app.kubernetes.io/managed-by", "helm.sh/chart")
ALL_CHARTS = (*SERVICE_CHARTS, UMBRELLA)


@pytest.fixture(scope="module")
def charts(tmp_path_factory):
    return build_charts(tmp_path_factory.mktemp("charts"))


@pytest.mark.parametrize("value_set", VALUE_SETS)
@pytest.mark.parametrize("chart", ALL_CHARTS)
def test_renders_lints_and_validates(charts, chart, value_set):
    values = values_for(chart, value_set)
    assert lint_findings(charts / chart, values) == []
    rendered = render(charts / chart, values)
    kinds = {m["kind"] for m in rendered.manifests}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceAccount"} <= kinds
    assert [e for m in rendered.manifests for e in schema_errors(m)] == []
    for manifest in rendered.manifests:
        labels = manifest["metadata"]["labels"]
        assert all(labels.get(key) for key in RECOMMENDED_LABELS), manifest["metadata"]["name"]
        assert labels["app.kubernetes.io/part-of"] == "llmserve"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_config_files_load_with_the_services_own_config_classes(charts, value_set, tmp_path):
    """The ConfigMap plus the Deployment's literal env overrides is a config the service accepts."""
    rendered = render(charts / UMBRELLA, values_for(UMBRELLA, value_set))
    for deployment in rendered.of_kind("Deployment"):
        service = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        container = only_container(deployment)
        path = container["command"][container["command"].index("--config") + 1]
        assert container["command"][:3] == ["python", "-m", f"services.{service}"]
        configmap = rendered.one("ConfigMap", deployment["metadata"]["name"])
        config_file = tmp_path / f"{service}.yaml"
        config_file.write_text(configmap["data"][path.rsplit("/", 1)[1]])
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        config = load_config(CONFIG_CLASSES[service], config_file, f"LLMSERVE_{service.upper()}", environ=env)
        if service == "gateway":
            validate_gateway(config)
        assert config.server.host == "0.0.0.0"


def test_worker_requests_a_gpu_and_mounts_the_model(charts):
    deployment = render(charts / "worker", {}).one("Deployment", "llmserve-worker")
    container = only_container(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "llmserve-models"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"

    hostpath = render(charts / "worker", PRODUCTION["worker"]).one("Deployment", "llmserve-worker")
    volumes = {v["name"]: v for v in hostpath["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"] == {"name": "model", "hostPath": {"path": "/srv/models", "type": "Directory"}}
    nfs = {"nfs": {"server": "nfs.internal", "path": "/models", "readOnly": True}}
    volume = render(charts / "worker", {"model": {"from": "volume", "volume": nfs}})
    volume = volume.one("Deployment", "llmserve-worker")
    assert {"name": "model", **nfs} in volume["spec"]["template"]["spec"]["volumes"]


@pytest.mark.parametrize("chart", ("router", "worker", "conversations"))
def test_grpc_services_use_native_grpc_probes(charts, chart):
    rendered = render(charts / chart, {})
    container = only_container(rendered.one("Deployment", f"llmserve-{chart}"))
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": grpc_port}, probe
    config = yaml.safe_load(rendered.one("ConfigMap", f"llmserve-{chart}")["data"][f"{chart}.yaml"])
    assert grpc_port == config["server"]["port"]


def test_worker_startup_probe_allows_a_slow_model_load(charts):
    container = only_container(render(charts / "worker", {}).one("Deployment", "llmserve-worker"))
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("chart", SERVICE_CHARTS)
def test_termination_grace_outlasts_the_services_drain(charts, chart):
    rendered = render(charts / chart, {})
    deployment = rendered.one("Deployment", f"llmserve-{chart}")
    pod = deployment["spec"]["template"]["spec"]
    config = yaml.safe_load(rendered.one("ConfigMap", f"llmserve-{chart}")["data"][f"{chart}.yaml"])
    drain = config["server"].get("grace_period_s", config["server"].get("shutdown_timeout_s"))
    pre_stop = only_container(deployment).get("lifecycle", {}).get("preStop", {}).get("sleep", {})
    assert pod["terminationGracePeriodSeconds"] > drain + pre_stop.get("seconds", 0)


def test_worker_headless_service_and_the_router_pool_that_resolves_it(charts):
    rendered = render(charts / UMBRELLA, {}, release="prod", namespace="serving")
    service = rendered.one("Service", "prod-worker-headless")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    pod_labels = rendered.one("Deployment", "prod-worker")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    router = yaml.safe_load(rendered.one("ConfigMap", "prod-router")["data"]["router.yaml"])
    pool = router["models"]["llama-3-8b-instruct"]
    assert pool["dns_name"] == "prod-worker-headless.serving.svc.cluster.local"
    assert pool["dns_port"] == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    worker = yaml.safe_load(rendered.one("ConfigMap", "prod-worker")["data"]["worker.yaml"])
    assert worker["model"]["name"] in router["models"]


def test_umbrella_wires_the_gateway_to_router_and_conversations(charts):
    rendered = render(charts / UMBRELLA, {}, release="prod", namespace="serving")
    gateway = yaml.safe_load(rendered.one("ConfigMap", "prod-gateway")["data"]["gateway.yaml"])
    for section, target in (("upstream", "prod-router"), ("conversations", "prod-conversations")):
        host, port = gateway[section]["address"].rsplit(":", 1)
        service = rendered.one("Service", host)
        assert host == target and int(port) in [p["port"] for p in service["spec"]["ports"]]


def test_hpa_metrics(charts):
    for chart in ("gateway", "router"):
        hpa = render(charts / chart, {}).one("HorizontalPodAutoscaler", f"llmserve-{chart}")
        assert hpa["spec"]["metrics"] == [{"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}]
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": f"llmserve-{chart}"}
    worker = render(charts / "worker", PRODUCTION["worker"])
    hpa = worker.one("HorizontalPodAutoscaler", "llmserve-worker")
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "vllm:num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "5"}}}]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 16)
    assert "replicas" not in worker.one("Deployment", "llmserve-worker")["spec"]   # the HPA owns it
    assert render(charts / "worker", {}).of_kind("HorizontalPodAutoscaler") == []  # needs an adapter


def test_autoscaling_off_fixes_the_replicas(charts):
    for chart in SERVICE_CHARTS:
        rendered = render(charts / chart, values_for(chart, "autoscaling-off"))
        assert rendered.of_kind("HorizontalPodAutoscaler") == []
        assert rendered.one("Deployment", f"llmserve-{chart}")["spec"]["replicas"] == 3


@pytest.mark.parametrize("chart", SERVICE_CHARTS)
def test_pod_disruption_budget_covers_the_pods(charts, chart):
    rendered = render(charts / chart, {})
    pdb = rendered.one("PodDisruptionBudget", f"llmserve-{chart}")
    assert pdb["spec"]["maxUnavailable"] == 1
    pod_labels = rendered.one("Deployment", f"llmserve-{chart}")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


@pytest.mark.parametrize("chart", SERVICE_CHARTS)
def test_pods_run_as_non_root_on_a_read_only_root(charts, chart):
    pod = render(charts / chart, {}).one("Deployment", f"llmserve-{chart}")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    container = only_container({"spec": {"template": {"spec": pod}}})
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_gateway_tls(charts):
    rendered = render(charts / "gateway", PRODUCTION["gateway"])
    deployment = rendered.one("Deployment", "llmserve-gateway")
    container = only_container(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "llmserve-gateway-tls"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LLMSERVE_GATEWAY__SERVER__TLS_CERT_FILE"] == f"{mount['mountPath']}/tls.crt"
    assert env["LLMSERVE_GATEWAY__SERVER__TLS_KEY_FILE"] == f"{mount['mountPath']}/tls.key"
    assert env["LLMSERVE_GATEWAY__SERVER__PLAIN_HTTP"] == "false"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"   # the gateway has no /readyz
    monitor = rendered.one("ServiceMonitor", "llmserve-gateway")
    assert monitor["spec"]["endpoints"][0]["scheme"] == "https"

    plain = only_container(render(charts / "gateway", {}).one("Deployment", "llmserve-gateway"))
    assert plain["livenessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert not any(e["name"].startswith("LLMSERVE_GATEWAY__SERVER__TLS") for e in plain["env"])


def test_existing_secrets_are_referenced_never_inlined(charts):
    rendered = render(charts / UMBRELLA, values_for(UMBRELLA, "production"))
    assert rendered.of_kind("Secret") == []
    for chart in ("gateway", "conversations"):
        container = only_container(rendered.one("Deployment", f"llmserve-{chart}"))
        refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e]
        assert refs and {r["name"] for r in refs} == {PRODUCTION[chart]["secrets"]["existingSecret"]}
        assert all(r["optional"] for r in refs)
    gateway_env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
                   for e in only_container(rendered.one("Deployment", "llmserve-gateway"))["env"]
                   if "valueFrom" in e}
    assert gateway_env == {"LLMSERVE_GATEWAY__AUTH__ADMIN_TOKEN": "adminToken",
                           "LLMSERVE_GATEWAY__RATE_LIMIT__REDIS_URL": "redisUrl",
                           "LLMSERVE_GATEWAY__DATABASE__URL": "databaseUrl"}


def test_chart_made_secrets_stay_out_of_configmaps(charts):
    rendered = render(charts / UMBRELLA, values_for(UMBRELLA, "chart-secrets"))
    for chart in ("gateway", "conversations"):
        secret = rendered.one("Secret", f"llmserve-{chart}")
        given = CHART_SECRETS[chart]["secrets"]["values"]
        assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == given
    configmaps = json.dumps(rendered.of_kind("ConfigMap"))
    assert "test-pw" not in configmaps and "admin-test-token" not in configmaps


def test_service_monitors_scrape_a_port_the_service_has(charts):
    rendered = render(charts / UMBRELLA, values_for(UMBRELLA, "servicemonitor-on"))
    monitors = rendered.of_kind("ServiceMonitor")
    assert len(monitors) == 4
    for monitor in monitors:
        name = monitor["metadata"]["name"]
        service = next(s for s in rendered.of_kind("Service")
                       if s["metadata"]["name"] in (name, f"{name}-headless"))
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]
        assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert render(charts / UMBRELLA, {}).of_kind("ServiceMonitor") == []


def test_a_second_worker_pool_by_alias_gets_its_own_names(charts):
    """Two pools in one release: the worker chart twice, the second under an alias."""
    umbrella = charts / "llmserve-two-pools"      # beside the others: file://../worker still resolves
    shutil.copytree(charts / UMBRELLA, umbrella, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    chart_yaml = yaml.safe_load((umbrella / "Chart.yaml").read_text())
    chart_yaml["dependencies"].append({"name": "worker", "alias": "worker-small", "version": "0.1.0",
                                       "repository": "file://../worker"})
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump(chart_yaml))
    helm.dependency_build(str(umbrella))
    rendered = render(umbrella, {"worker-small": {"config": {"model": {"name": "smollm2"}}}})
    selectors = [d["spec"]["selector"]["matchLabels"] for d in rendered.of_kind("Deployment")]
    assert len({json.dumps(s, sort_keys=True) for s in selectors}) == len(selectors) == 5
    assert rendered.one("Service", "llmserve-worker-small-headless")["spec"]["clusterIP"] == "None"
    assert [e for m in rendered.manifests for e in schema_errors(m)] == []


@pytest.mark.parametrize("chart, values, message", [
    ("gateway", {"secrets": {"existingSecret": "mine", "values": {"adminToken": "x"}}},
     "set existingSecret or values, not both"),
    ("gateway", {"tls": {"enabled": True}}, "tls.secretName"),
    ("router", {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
     "minReplicas \\(5\\) exceeds maxReplicas"),
    ("worker", {"model": {"from": "volume"}}, "model.from is volume but model.volume is empty"),
    # values.schema.json: misspelt keys and wrong types are errors, not ignored settings
    ("worker", {"model": {"from": "s3"}}, "/model/from': value must be one of 'persistentVolumeClaim'"),
    ("gateway", {"autoscalling": {"enabled": False}}, "additional properties 'autoscalling' not allowed"),
    ("router", {"autoscaling": {"minReplica": 3}}, "/autoscaling': additional properties 'minReplica'"),
    ("conversations", {"probes": {"startup": {"periodSeconds": "10s"}}}, "got string, want integer"),
    ("llmserve", {"worker": {"shm": {"size": "1Gi"}}}, "worker:\n- at '/shm': additional properties 'size'"),
])
def test_bad_values_fail_with_a_clear_message(charts, chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(charts / chart, values)


@pytest.mark.parametrize("chart", SERVICE_CHARTS)
def test_values_schema_is_what_the_generator_writes(chart):
    committed = (CHARTS_DIR / chart / "values.schema.json").read_text()
    assert committed == values_schema.schema_text(chart), "run: python deploy/k8s/values_schema.py"


def test_notes_tell_how_to_reach_the_api(charts):
    notes = render(charts / UMBRELLA, {}, release="prod", namespace="serving").notes
    assert "kubectl -n serving port-forward svc/prod-gateway" in notes
    assert "WARNING: the gateway has no Postgres URL" in notes
    assert "WARNING" not in render(charts / UMBRELLA, values_for(UMBRELLA, "production")).notes


@pytest.mark.parametrize("chart, warns_of", [("gateway", ("no Postgres URL", "backend is memory")),
                                             ("conversations", ("no Postgres URL",)),
                                             ("router", ()), ("worker", ())])
def test_service_chart_notes_warn_of_trial_settings_only(charts, chart, warns_of):
    trial = render(charts / chart, {}).notes
    production = render(charts / chart, values_for(chart, "production")).notes
    assert "llmserve-" + chart in trial and "llmserve-" + chart in production
    assert all(warning in trial for warning in warns_of)
    assert "WARNING" not in production
    if chart == "router":
        pool = "smollm2-135m-instruct: DNS llmserve-worker-small-headless.llm.svc.cluster.local:50051"
        assert pool in production


def only_container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_a_tensor_parallel_worker_gets_its_gpus_and_shared_memory(charts):
    """tensor_parallel_size 8 (Llama-3-70B): the pod requests 8 GPUs and mounts /dev/shm for NCCL;
    a pod given fewer GPUs than ranks is refused at render time."""
    gpus = {"nvidia.com/gpu": 8}
    values = {"config": {"engine": {"tensor_parallel_size": 8}}, "shm": {"sizeLimit": "16Gi"},
              "resources": {"requests": {"cpu": "16", "memory": "256Gi", **gpus},
                            "limits": {"memory": "512Gi", **gpus}}}
    rendered = render(charts / "worker", values)
    container = only_container(rendered.one("Deployment", "llmserve-worker"))
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 8 == resources["requests"]["nvidia.com/gpu"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    worker = yaml.safe_load(rendered.one("ConfigMap", "llmserve-worker")["data"]["worker.yaml"])
    assert worker["engine"]["tensor_parallel_size"] == 8
    with pytest.raises(helm.HelmError, match="tensor_parallel_size 8 needs resources.requests nvidia.com/gpu: 8"):
        render(charts / "worker", {"config": {"engine": {"tensor_parallel_size": 8}}})
