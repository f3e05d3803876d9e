"""Configuration loading and worker discovery (static, DNS re-resolution)."""

import pytest

from llmserve.config import ConfigError, load_config
from services.router.config import DiscoveryConfig, PoolConfig, RouterConfig
from services.router.discovery import Discovery, check_address, resolve_dns
from services.router.pool import WorkerRegistry


def test_config_from_yaml_and_environment(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("models:\n  smol:\n    addresses: [10.0.0.1:50051]\n    dns_name: workers.svc\n"
                    "policy:\n  name: round_robin\n")
    config = load_config(RouterConfig, path, "LLMSERVE_ROUTER",
                         environ={"LLMSERVE_ROUTER__SERVER__PORT": "6000",
                                  "LLMSERVE_ROUTER__POLICY__CACHE_THRESHOLD": "0.5"})
    assert config.models["smol"] == PoolConfig(addresses=["10.0.0.1:50051"], dns_name="workers.svc")
    assert (config.server.port, config.server.metrics_port) == (6000, 9150)
    assert (config.policy.name, config.policy.cache_threshold) == ("round_robin", 0.5)
    with pytest.raises(ConfigError):
        load_config(RouterConfig, None, "LLMSERVE_ROUTER", environ={"LLMSERVE_ROUTER__POLICY__NAME": "random"})


@pytest.mark.parametrize("address", ["10.0.0.1", ":50051", "host:port", "host:0", "host:70000"])
def test_bad_addresses_are_refused(address):
    with pytest.raises(ValueError, match="host:port"):
        check_address(address)


async def test_static_workers_and_empty_pools_are_created():
    registry = WorkerRegistry(100, close_grace_s=0)
    Discovery(registry, {"a": PoolConfig(addresses=["127.0.0.1:1", "127.0.0.1:2"]), "b": PoolConfig()},
              DiscoveryConfig()).add_static()
    assert sorted(registry.pools) == ["a", "b"]
    assert [(w.address, w.source) for w in registry.workers("a")] == [("127.0.0.1:1", "static"), ("127.0.0.1:2", "static")]
    await registry.close()


async def test_dns_is_re_resolved_and_departed_addresses_leave():
    answers = [{"10.0.0.1:50051", "10.0.0.2:50051"}, {"10.0.0.2:50051", "10.0.0.3:50051"}, OSError("no answer")]

    async def resolver(name: str, port: int) -> set[str]:
        assert (name, port) == ("workers.svc", 50051)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    registry = WorkerRegistry(100, close_grace_s=0)
    discovery = Discovery(registry, {"m": PoolConfig(dns_name="workers.svc")}, DiscoveryConfig(), resolver)
    await discovery.refresh_dns()
    assert sorted(w.address for w in registry.workers("m")) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    kept = registry.find("10.0.0.2:50051")
    await discovery.refresh_dns()
    assert sorted(w.address for w in registry.workers("m")) == ["10.0.0.2:50051", "10.0.0.3:50051"]
    assert registry.find("10.0.0.2:50051") is kept and kept.source == "dns"
    await discovery.refresh_dns()     # a failed lookup keeps the pool as it was
    assert len(registry.workers("m")) == 2
    await registry.close()


async def test_the_system_resolver_formats_addresses():
    assert "127.0.0.1:50051" in await resolve_dns("127.0.0.1", 50051)
