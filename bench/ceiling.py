"""How close can an asyncio server get to Redis here? ``python -m bench.ceiling [CONNS DEPTH]``.

Runs the same raw load against three servers, alternating, 3 rounds: the node (memory
storage), a trivial uvloop server that answers every MessagePack-RPC request with a constant
(no validation, no counting: the ceiling of a Python asyncio server on this machine), and a
private redis-server (INCR). Prints ops/s and p50/p99 per round. A diagnostic, not part of the
main table: it tells how much of the gap to Redis is the event loop and how much is the node.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import RedisServer
from bench.loadgen import Load, run_load
from tests.support.nodes import NodeProcess, short_tmpdir


def trivial_server(path: str) -> None:
    """Answer every request ``[0, msgid, ...]`` with ``[1, msgid, nil, 1]``."""
    import msgpack
    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.unpacker = msgpack.Unpacker()

        def data_received(self, data: bytes) -> None:
            self.unpacker.feed(data)
            self.transport.write(b"".join(msgpack.packb([1, m[1], None, 1]) for m in self.unpacker))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_unix_server(Echo, path)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


def main(conns: int = 4, depth: int = 1, rounds: int = 3, duration: float = 1.5) -> None:
    """Run the comparison and print one line per server per round."""
    workdir = short_tmpdir("meter-ceiling-")
    trivial_path = str(workdir / "trivial.sock")
    trivial = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from bench.ceiling import trivial_server; trivial_server({trivial_path!r})",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    node = NodeProcess(workdir, METER_STORAGE="memory", METER_LOG_LEVEL="WARNING").start()
    redis = RedisServer(workdir).start()
    try:
        while not Path(trivial_path).exists():
            time.sleep(0.05)
        print(f"{conns} connections, depth {depth}, {rounds} rounds of {duration} s")
        for r in range(rounds):
            for name, load in (
                ("node", Load("meter", str(node.socket), "track", conns, depth, duration=duration)),
                ("trivial", Load("meter", trivial_path, "track", conns, depth, duration=duration)),
                (
                    "redis",
                    Load("redis", str(redis.socket), "incr", conns, depth, duration=duration),
                ),
            ):
                res = run_load(load)
                print(
                    f"round {r + 1}  {name:8} {res.ops_per_s:>11,.0f} ops/s  "
                    f"p50 {res.percentile_us(50):7.1f} us  p99 {res.percentile_us(99):7.1f} us"
                )
    finally:
        trivial.kill()
        node.stop()
        redis.stop()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    main(*args)
