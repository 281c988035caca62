"""A TCP forwarder on 127.0.0.1 whose connections share one bandwidth cap.

:class:`Throttle` listens on a free loopback port and forwards every connection to a
target (``host``, ``port``), in both directions. All bytes it forwards, of every
connection and both directions, pass one token bucket of ``rate`` bytes per second:
the cap is the link's, shared by every client, as a store's egress or a host's NIC is.
``rate=0`` forwards without a cap. It runs an asyncio loop in a daemon thread, so a
benchmark's server process can host it next to the server it fronts
(benchmarks/fanout.py puts it in front of tests/storage_servers.S3Server).

The bucket is a virtual clock: each piece of ``n`` bytes is given the next free
``n / rate`` seconds of the link and waits for their end, so pieces leave in the order
they arrived and the link never runs faster than ``rate`` over any stretch longer than
one ``burst`` (a piece is at most ``burst`` bytes).
"""

from __future__ import annotations

import asyncio
import threading
import time

PIECE = 64 << 10


class Throttle:
    """Forwards ``127.0.0.1:<port>`` to ``host:port`` under one cap of ``rate`` B/s.

    Attributes:
      port: the port it listens on (a free one).
      forwarded: bytes forwarded so far, both directions, every connection.
    """

    def __init__(self, host: str, port: int, rate: float, *, burst: int = PIECE) -> None:
        if rate < 0 or burst <= 0:
            raise ValueError(f"Throttle: rate {rate} must be >= 0 and burst {burst} > 0")
        self.target = (host, port)
        self.rate = float(rate)
        self.burst = burst
        self.forwarded = 0
        self._free_at = 0.0  # when the link is next free (time.monotonic())
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(30)
        if not hasattr(self, "port"):
            raise RuntimeError("Throttle: the forwarder did not start within 30 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0, backlog=128)
        )
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()
        server.close()
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _take(self, n: int) -> None:
        """Wait for ``n`` bytes' turn on the link (one loop thread: no lock needed)."""
        self.forwarded += n
        if not self.rate:
            return
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + n / self.rate
        if (wait := self._free_at - now) > 0:
            await asyncio.sleep(wait)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while piece := await reader.read(self.burst):
                await self._take(len(piece))
                writer.write(piece)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                if writer.can_write_eof():
                    writer.write_eof()
            except (ConnectionError, OSError, RuntimeError):
                writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
