"""The value sets every chart is rendered, linted and validated with."""

from __future__ import annotations

PRODUCTION = {
    "gateway": {
        "tls": {"enabled": True, "secretName": "llmserve-gateway-tls"},
        "service": {"type": "LoadBalancer", "port": 443},
        "secrets": {"existingSecret": "llmserve-gateway-secrets"},
        "config": {"rate_limit": {"backend": "redis", "fail_mode": "closed"}},
        "autoscaling": {"minReplicas": 3, "maxReplicas": 40},
        "serviceMonitor": {"enabled": True, "tlsConfig": {"insecureSkipVerify": True}},
        "podDisruptionBudget": {"minAvailable": 2},
    },
    "router": {
        "config": {"models": {
            "llama-3-8b-instruct": {"dns_name": "llmserve-worker-headless.llm.svc.cluster.local"},
            "smollm2-135m-instruct": {"dns_name": "llmserve-worker-small-headless.llm.svc.cluster.local",
                                      "dns_port": 50051},
        }},
        "serviceMonitor": {"enabled": True},
    },
    "worker": {
        "model": {"from": "hostPath", "hostPath": {"path": "/srv/models"}},
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 16},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "priorityClassName": "llm-serving",
    },
    "conversations": {
        "secrets": {"existingSecret": "llmserve-conversations-secrets"},
        "replicaCount": 2,
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
        "serviceMonitor": {"enabled": True},
    },
}

AUTOSCALING_OFF = {chart: {"autoscaling": {"enabled": False}, "replicaCount": 3,
                           "podDisruptionBudget": {"minAvailable": 1}}
                   for chart in ("gateway", "router", "worker", "conversations")}

SERVICE_MONITOR_ON = {chart: {"serviceMonitor": {"enabled": True}}
                      for chart in ("gateway", "router", "worker", "conversations")}

# Secrets the chart makes itself (trials): the values land in a Secret, never in a ConfigMap.
CHART_SECRETS = {
    "gateway": {"secrets": {"values": {"adminToken": "admin-test-token",
                                       "redisUrl": "redis://:redis-test-pw@redis:6379/0",
                                       "databaseUrl": "postgresql://gw:pg-test-pw@postgres/llmserve"}}},
    "router": {},
    "worker": {},
    "conversations": {"secrets": {"values": {"databaseUrl": "postgresql://cv:pg-test-pw@postgres/llmserve"}}},
}

VALUE_SETS = {
    "defaults": {},
    "production": PRODUCTION,
    "autoscaling-off": AUTOSCALING_OFF,
    "servicemonitor-on": SERVICE_MONITOR_ON,
    "chart-secrets": CHART_SECRETS,
}


def values_for(chart: str, value_set: str) -> dict:
    """A service chart takes its own entry; the umbrella takes them all, under the chart names."""
    values = VALUE_SETS[value_set]
    if chart == "llmserve":
        return values
    return values.get(chart, {})
