"""Storage backends for in-process tests: the in-memory one, with faults switched on by hand."""

from __future__ import annotations

import asyncio
from typing import Any

from storage.base import StorageUnavailable
from storage.memory import MemoryStorage


class DownStorage(MemoryStorage):
    """A store that can be switched off: every call raises StorageUnavailable."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def load(self, keys: Any) -> Any:
        if self.down:
            raise StorageUnavailable("down")
        return await super().load(keys)

    async def list_period(self, tenant: str, period: str) -> Any:
        if self.down:
            raise StorageUnavailable("down")
        return await super().list_period(tenant, period)

    async def list_between(self, tenant: str, period: str, first: str, last: str) -> Any:
        if self.down:
            raise StorageUnavailable("down")
        return await super().list_between(tenant, period, first, last)

    async def limits_version(self) -> int:
        if self.down:
            raise StorageUnavailable("down")
        return await super().limits_version()

    async def write_limit(
        self, scope: str, name: str, feature: str, body: str | None, expect: int | None = None
    ) -> int:
        if self.down:
            raise StorageUnavailable("down")
        return await super().write_limit(scope, name, feature, body, expect)


class SlowStorage(MemoryStorage):
    """A store whose counter reads wait until ``release`` is set (``reading`` is set when
    one starts): a test can act while a cold key is being seeded."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    async def load(self, keys: Any) -> Any:
        self.reading.set()
        await self.release.wait()
        return await super().load(keys)
