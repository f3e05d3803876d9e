"""The overload guard's view of the pool: each model's routable workers (healthy, not drained by
the admin, not shutting down) with their last load reports, polled from the router's ListWorkers,
and how many gateway replicas share them (replicas.py, one heartbeat a poll).

An upstream that is a single worker (no Router service) counts as one worker per model. A failed
poll keeps the last counts: while the router is unreachable requests fail on their own anyway.
"""

from __future__ import annotations

import asyncio
import logging

from services.gateway.errors import ApiError
from services.gateway.overload import OverloadGuard
from services.gateway.replicas import Replicas
from services.gateway.upstream import Upstream

log = logging.getLogger(__name__)


class PoolWatch:
    def __init__(self, upstream: Upstream, guard: OverloadGuard, replicas: Replicas, interval_s: float):
        self._upstream = upstream
        self._guard = guard
        self._replicas = replicas
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._replicas.close()

    async def poll(self) -> bool:
        """One poll; False when there is nothing to poll (the upstream is a worker)."""
        replicas = await self._replicas.beat()
        try:
            workers = await self._upstream.list_workers()
        except ApiError as e:
            if e.status == 501:
                self._guard.set_workers({}, default=1, replicas=replicas)
                return False
            return True       # logged by the upstream client
        reports: dict[str, list] = {w.model: [] for w in workers}
        for w in workers:
            if w.healthy and not w.draining and not w.load.draining:
                reports[w.model].append(w.load)
        self._guard.set_pool(reports, replicas=replicas)
        return True

    async def _run(self) -> None:
        while True:
            try:
                if not await self.poll():
                    return
            except Exception:
                log.exception("polling the router's workers failed")
            await asyncio.sleep(self._interval_s)
