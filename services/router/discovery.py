"""Where workers come from: static addresses, a Kubernetes headless service's DNS name
(re-resolved, each address one worker), and workers registering themselves."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Awaitable, Callable

from .config import DiscoveryConfig, PoolConfig
from .pool import Worker, WorkerRegistry

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[set[str]]]


def check_address(address: str) -> str:
    """Returns a host:port address unchanged, or raises ValueError saying what is wrong with it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address must be host:port, got {address!r}")
    return address


async def resolve_dns(name: str, port: int) -> set[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for *_, (ip, *_) in infos}


class Discovery:
    def __init__(self, registry: WorkerRegistry, models: dict[str, PoolConfig],
                 config: DiscoveryConfig, resolve: Resolver = resolve_dns):
        self.registry = registry
        self.models = models
        self.config = config
        self.resolve = resolve

    def add_static(self) -> None:
        """Creates every configured pool (even an empty one) and its static workers."""
        for model, pool in self.models.items():
            self.registry.pool(model, create=True)
            for address in pool.addresses:
                self.registry.add(check_address(address), model, "static")

    async def run(self) -> None:
        while True:
            await self.refresh_dns()
            await asyncio.sleep(self.config.dns_interval_s)

    async def refresh_dns(self) -> None:
        for model, pool in self.models.items():
            if not pool.dns_name:
                continue
            try:
                found = await self.resolve(pool.dns_name, pool.dns_port)
            except OSError as e:   # keep what we have: a DNS hiccup must not empty the pool
                log.warning("resolving %s failed: %s", pool.dns_name, e)
                continue
            known = {w.address for w in self.registry.workers(model) if w.source == "dns"}
            for address in sorted(found - known):
                log.info("worker %s (%s) found in DNS", address, model)
                self.registry.add(address, model, "dns")
            for address in sorted(known - found):
                log.info("worker %s (%s) left DNS", address, model)
                self.registry.remove(address)

    def register(self, address: str, model: str) -> Worker:
        if not model:
            raise ValueError("model is required to register a worker")
        return self.registry.add(check_address(address), model, "registered")
