"""A service with a write-ahead log, built and recovered as a node does before its socket
opens (its limits and declarations read first): for tests that restart one in place."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from meter.config import CounterConfig
from meter.core.idempotency import RequestIds
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service
from meter.persist.recovery import recover
from meter.quotas.store import LimitStore
from meter.wal.log import WriteAheadLog
from storage.base import Storage
from storage.memory import MemoryStorage


class SlowLoads(MemoryStorage):
    """Memory storage whose reads of counters wait for :attr:`gate` while it is set and
    not open (a slow or stalled storage, for calls that wait on a cold counter)."""

    gate: asyncio.Event | None = None

    async def load(self, keys: Any) -> Any:
        if self.gate is not None:
            await self.gate.wait()
        return await super().load(keys)


async def logged_service(
    directory: Path, store: Storage, node: str = "n1", config: CounterConfig | None = None
) -> tuple[Service, WriteAheadLog]:
    """A service of ``node`` over ``store`` with its log in ``directory`` (fsync mode),
    recovered from what the log holds."""
    wal = WriteAheadLog(directory, node_id=node, mode="fsync")
    svc = build_service(CounterTable(node), store, config or CounterConfig(), wal=wal,
                        ids=RequestIds(3600, 10_000))  # fmt: skip
    await cast(LimitStore, svc.limits).refresh()
    await recover(wal, svc)
    return svc, wal
