"""deploy/local/run.py (`make run`): the configs it writes load as each service's own, the two URL
variables switch the stores, and stopping reaches stubborn process groups."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmserve.config import load_config
from services.gateway.config import validate

RUN_PY = Path(__file__).resolve().parents[2] / "deploy" / "local" / "run.py"


@pytest.fixture(scope="module")
def launcher():
    spec = importlib.util.spec_from_file_location("llmserve_local_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_written_configs_load_as_the_services_own(launcher, tmp_path):
    services = {s.name: s for s in launcher.plan({})}
    assert list(services) == ["conversations", "worker", "worker-int8", "router", "gateway"]
    for service in services.values():
        path = tmp_path / f"{service.name}.yaml"
        path.write_text(yaml.safe_dump(launcher.dataclasses.asdict(service.config)))
        assert load_config(type(service.config), path) == service.config
    validate(services["gateway"].config)

    workers = {s.config.model.name: s for s in services.values() if s.module == "services.worker"}
    assert {m: (w.config.model.quantization, w.config.engine.num_threads, w.config.engine.kv_cache_dtype)
            for m, w in workers.items()} == {"smollm2-135m-instruct": ("none", os.cpu_count() or 2, "bfloat16"),
                                             "smollm2-135m-instruct-int8": ("int8", 1, "bfloat16")}
    router = services["router"].config
    assert {m: p.addresses for m, p in router.models.items()} == {m: [w.address] for m, w in workers.items()}
    gateway = services["gateway"].config
    assert gateway.upstream.address == services["router"].address
    assert gateway.conversations.address == services["conversations"].address
    assert gateway.local_mode.enabled and gateway.rate_limit.backend == "memory"
    assert services["conversations"].config.store.url.startswith("sqlite:///")


def test_url_variables_switch_to_postgres_and_redis(launcher):
    services = {s.name: s.config for s in launcher.plan({
        "LLMSERVE_DATABASE_URL": "postgresql://app:secret@db:5432/llmserve",
        "LLMSERVE_REDIS_URL": "redis://cache:6379/0"})}
    assert services["conversations"].store.url == "postgresql://app:secret@db:5432/llmserve"
    assert services["gateway"].database.url == "postgresql://app:secret@db:5432/llmserve"
    assert (services["gateway"].rate_limit.backend, services["gateway"].rate_limit.redis_url) == (
        "redis", "redis://cache:6379/0")
    assert launcher._redacted("postgresql://app:secret@db:5432/x") == "postgresql://app:***@db:5432/x"


def test_stop_all_terminates_then_kills_after_the_grace_period(launcher):
    def spawn(script: str) -> subprocess.Popen:
        return subprocess.Popen(["sh", "-c", script], start_new_session=True)

    polite = launcher.Service("polite", "", None, "", "", "", ())
    stubborn = launcher.Service("stubborn", "", None, "", "", "", ())
    polite.process = spawn("sleep 60")
    # Ignores SIGTERM, and so does the child it leaves in its group.
    stubborn.process = spawn("trap '' TERM; sleep 60 & sleep 60")
    time.sleep(0.3)   # let the trap be installed
    started = time.monotonic()
    launcher.stop_all([polite, stubborn], grace_s=1.0)
    assert polite.process.returncode != 0 and stubborn.process.returncode == -9
    assert time.monotonic() - started < 10
    # The stubborn group's background sleep went too (it may linger a moment as a zombie).
    assert _alive_in_group(stubborn.process.pid) == []


def _alive_in_group(pgid: int) -> list[str]:
    table = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [line for line in table.splitlines()
            if line.split()[1] == str(pgid) and not line.split()[2].startswith("Z")]


def test_port_offset_and_var_dir_move_the_whole_platform(launcher, tmp_path):
    default = {s.name: s for s in launcher.plan({})}
    moved = {s.name: s for s in launcher.plan({}, port_offset=1000, var_dir=tmp_path)}
    for name, service in moved.items():
        assert service.ports == tuple(p + 1000 for p in default[name].ports)
    assert moved["gateway"].address == "http://127.0.0.1:9080"
    gateway = moved["gateway"].config
    assert (gateway.upstream.address, gateway.conversations.address) == (
        moved["router"].address, moved["conversations"].address)
    assert set(moved["router"].config.models["smollm2-135m-instruct"].addresses) == {moved["worker"].address}
    assert gateway.database.url == f"sqlite:///{tmp_path.resolve()}/gateway.db"
    assert moved["conversations"].config.store.url == f"sqlite:///{tmp_path.resolve()}/conversations.db"
    assert "http://127.0.0.1:9080/v1/chat/completions" in launcher.summary(list(moved.values()))


def test_port_base_numbers_every_port_in_a_small_range(launcher):
    services = launcher.plan({}, port_base=47200)
    ports = sorted(p for s in services for p in s.ports)
    assert ports == list(range(47200, 47200 + len(launcher.DEFAULT_PORTS)))
    by_name = {s.name: s for s in services}
    assert by_name["gateway"].address == "http://127.0.0.1:47208"
    assert by_name["gateway"].config.upstream.address == by_name["router"].address
