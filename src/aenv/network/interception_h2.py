"""Header rules for a guest that speaks HTTP/2: each of its streams becomes a request to the
server with the rules' headers set. A server that chose HTTP/2 too (ALPN; the proxy offers it
only to a guest that offered it) gets each stream as a stream of one shared connection
(`h2_upstream`: gRPC, trailers, streaming both ways). Any other gets an HTTP/1.1 request, over
verified connections the proxy keeps for the guest's connection (one per stream in flight,
reused by later streams), as follows.

The guest's side is h2's server state machine: requests (`:method`, `:path`, `:authority`
become the request line and `Host`), request bodies forwarded as the server takes them (the
guest's flow-control window is given back only then, so a slow server holds the guest back
rather than the proxy's memory), responses sent within the guest's windows. What HTTP/1.1
cannot carry is not offered: no server push, no extended CONNECT (WebSockets over HTTP/2).
Trailers cross both ways (in chunked HTTP/1.1 bodies). A stream the server fails is reset,
never answered with something else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from functools import partial

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h11

from aenv.network.h2_upstream import H2Upstream, send_within_window
from aenv.network.header_rules import FRAMING, HeadersNow, apply
from aenv.network.interception import Stream, closes, connection, raw_length, splice

Connect = Callable[[], Awaitable[Stream]]
# Headers of an HTTP/1.1 response that mean nothing (or are forbidden) in HTTP/2.
_HOP = FRAMING - {"host"}
# Streams in flight per guest connection: each holds a connection to the server.
MAX_STREAMS = 32


class _Upstream:
    """A verified connection to the server and its HTTP/1.1 state."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def next_event(self) -> object:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.read())

    async def send(self, event: h11.Event) -> None:
        if data := self.h11.send(event):
            await self.stream.write(data)


class Bridge:
    """One guest connection speaking HTTP/2 (`down`), whose first server connection is `up`
    and further ones come from `connect`."""

    def __init__(
        self,
        down: Stream,
        up: Stream,
        connect: Connect,
        rule_headers: HeadersNow,
    ) -> None:
        self._down = down
        self._connect = connect
        self._rules = rule_headers
        self._first: Stream | None = up
        self._idle: list[_Upstream] = []
        # The server's HTTP/2 connections (the newest serves new streams; one ends, another is
        # made).
        self._h2_servers: list[H2Upstream] = []
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self._h2 = h2.connection.H2Connection(config)
        # Per stream: its body chunks and their flow-controlled lengths; None ends it.
        self._bodies: dict[int, asyncio.Queue[tuple[bytes, int] | None]] = {}
        self._trailers: dict[int, list[tuple[bytes, bytes]]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._window = asyncio.Event()

    async def _flush(self) -> None:
        if data := self._h2.data_to_send():
            await self._down.write(data)

    async def run(self) -> None:
        """Serve the guest's streams until it closes the connection or sends GOAWAY."""
        self._h2.initiate_connection()
        self._h2.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS})
        await self._flush()
        try:
            while data := await self._down.read():
                for event in self._h2.receive_data(data):
                    self._handle(event)
                    if isinstance(event, h2.events.ConnectionTerminated):
                        return
                await self._flush()
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            for server in self._h2_servers:
                await server.close()

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            assert event.stream_id is not None and event.headers is not None
            # Unbounded: what the guest may send is bounded by its window for the stream, which
            # only the server's reads give back (`_upload`).
            self._bodies[event.stream_id] = asyncio.Queue()
            ended = event.stream_ended is not None
            task = asyncio.ensure_future(self._stream(event.stream_id, list(event.headers), ended))
            self._tasks[event.stream_id] = task
        elif isinstance(event, h2.events.DataReceived):
            assert event.stream_id is not None and event.data is not None
            assert event.flow_controlled_length is not None
            if (queue := self._bodies.get(event.stream_id)) is not None:
                queue.put_nowait((event.data, event.flow_controlled_length))
            else:  # a stream already done: its data must not hold the connection's window
                self._acknowledge(event.stream_id, event.flow_controlled_length)
        elif isinstance(event, h2.events.TrailersReceived):
            assert event.stream_id is not None and event.headers is not None
            self._trailers[event.stream_id] = list(event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            if (queue := self._bodies.get(event.stream_id or 0)) is not None:
                queue.put_nowait(None)
        elif isinstance(event, h2.events.StreamReset):
            if (running := self._tasks.get(event.stream_id or 0)) is not None:
                running.cancel()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._window.set()

    async def _server(self) -> _Upstream | H2Upstream:
        """Where a new stream goes: the server's HTTP/2 connection if it has a live one, an idle
        HTTP/1.1 connection, or a new connection (HTTP/2 if the server chose it)."""
        if self._h2_servers and not self._h2_servers[-1].closed:
            return self._h2_servers[-1]
        if self._idle:
            return self._idle.pop()
        stream, self._first = self._first or await self._connect(), None
        if stream.alpn != "h2":
            return _Upstream(stream)
        server = H2Upstream(stream)
        self._h2_servers.append(server)
        await server.start()
        return server

    async def _stream(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: bool
    ) -> None:
        upstream: _Upstream | H2Upstream | None = None
        reusable = False
        try:
            upstream = await self._server()
            if isinstance(upstream, H2Upstream):
                await self._exchange_h2(stream_id, headers, ended, upstream)
            else:
                reusable = await self._exchange(stream_id, headers, ended, upstream)
        except (h11.ProtocolError, h2.exceptions.ProtocolError, ConnectionError, OSError):
            reusable = False
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
            with contextlib.suppress(OSError, ConnectionError):
                await self._flush()
        finally:
            # What the server never took (it answered early, or failed) is given back too.
            if (queue := self._bodies.pop(stream_id, None)) is not None:
                while not queue.empty():
                    if (item := queue.get_nowait()) is not None:
                        self._acknowledge(stream_id, item[1])
            self._trailers.pop(stream_id, None)
            self._tasks.pop(stream_id, None)
        if reusable and isinstance(upstream, _Upstream):
            self._idle.append(upstream)

    async def _exchange_h2(
        self,
        stream_id: int,
        headers: list[tuple[bytes, bytes]],
        ended: bool,
        server: H2Upstream,
    ) -> None:
        """The stream as a stream of the server's HTTP/2 connection: the guest's headers (h2
        checked them: no connection-specific ones, `te` only as `trailers`) with the rules'
        set, bodies and trailers both ways, a reset either way passed on."""
        pseudo = [(n, v) for n, v in headers if n.startswith(b":")]
        fields = [(n, v) for n, v in headers if not n.startswith(b":")]
        request = pseudo + [(n.lower(), v) for n, v in apply(fields, self._rules())]
        server_id = await server.request(request, end_stream=ended)
        finished = False
        upload = None
        if not ended:
            upload = asyncio.ensure_future(self._upload_h2(stream_id, server, server_id))
        try:
            reset = await self._download_h2(stream_id, server, server_id)
            if upload is not None and not reset:
                try:
                    await upload
                except h2.exceptions.StreamClosedError:
                    # The server answered in full and closed the stream before the guest's
                    # request ended: the guest is told to stop sending, as RFC 9113 8.1 says.
                    self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
                    await self._flush()
            finished = True
        finally:
            if upload is not None:
                upload.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await upload
            await server.forget(server_id, reset=not finished)

    async def _upload_h2(self, stream_id: int, server: H2Upstream, server_id: int) -> None:
        queue = self._bodies[stream_id]
        while (item := await queue.get()) is not None:
            chunk, length = item
            await server.send_data(server_id, chunk)
            # The server's windows took it: the guest may send as much again.
            self._acknowledge(stream_id, length)
            await self._flush()
        await server.end(server_id, self._trailers.pop(stream_id, []))

    async def _download_h2(self, stream_id: int, server: H2Upstream, server_id: int) -> bool:
        """The server's response to the guest; True if the server reset the stream."""
        while True:
            event = await server.next_event(server_id)
            if isinstance(event, h2.events.ResponseReceived):
                assert event.headers is not None
                self._h2.send_headers(stream_id, list(event.headers))
                await self._flush()
            elif isinstance(event, h2.events.DataReceived):
                assert event.data is not None and event.flow_controlled_length is not None
                await self._send(stream_id, event.data)
                await server.acknowledge(server_id, event.flow_controlled_length)
            elif isinstance(event, h2.events.TrailersReceived):
                assert event.headers is not None
                self._h2.send_headers(stream_id, list(event.headers), end_stream=True)
                await self._flush()
                return False
            elif isinstance(event, h2.events.StreamEnded):
                self._h2.end_stream(stream_id)
                await self._flush()
                return False
            elif isinstance(event, h2.events.StreamReset):
                # Passed on as the server said it (gRPC cancels with CANCEL, for one).
                self._h2.reset_stream(stream_id, event.error_code or 0)
                await self._flush()
                return True
            # 1xx responses: nothing the guest needs from them here.

    async def _exchange(
        self,
        stream_id: int,
        headers: list[tuple[bytes, bytes]],
        ended: bool,
        upstream: _Upstream,
    ) -> bool:
        pseudo = {n: v for n, v in headers if n.startswith(b":")}
        skip = (b"te", b"cookie")
        fields = [(n, v) for n, v in headers if not n.startswith(b":") and n not in skip]
        if b":authority" in pseudo and not any(n == b"host" for n, _ in fields):
            fields.insert(0, (b"host", pseudo[b":authority"]))
        # HTTP/2 may split cookies into several fields; HTTP/1.1 has one (RFC 9113 8.2.3).
        if cookies := [v for n, v in headers if n == b"cookie"]:
            fields.append((b"cookie", b"; ".join(cookies)))
        queue = self._bodies[stream_id]
        if not ended and not any(n == b"content-length" for n, _ in fields):
            fields.append((b"transfer-encoding", b"chunked"))
        request = h11.Request(
            method=pseudo.get(b":method", b"GET"),
            target=pseudo.get(b":path", b"/"),
            headers=apply(fields, self._rules()),
        )
        await upstream.send(request)
        upload = asyncio.ensure_future(self._upload(stream_id, queue, upstream))
        try:
            spliced = await self._download(stream_id, upstream, request, upload)
            await upload
        finally:
            upload.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await upload
        conn = upstream.h11
        if spliced is not None:  # h11 saw the response's head only: it starts anew
            leftover, keep_alive = spliced
            upstream.h11 = connection(h11.CLIENT, leftover, conn.trailing_data[1])
            return keep_alive
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            return True
        return False

    def _acknowledge(self, stream_id: int, length: int) -> None:
        # h2 gives a closed stream's share back to the connection's window alone.
        self._h2.acknowledge_received_data(length, stream_id)

    async def _upload(
        self,
        stream_id: int,
        queue: asyncio.Queue[tuple[bytes, int] | None],
        upstream: _Upstream,
    ) -> None:
        while (item := await queue.get()) is not None:
            chunk, length = item
            await upstream.send(h11.Data(data=chunk))
            # The server took it: the guest may send as much again.
            self._acknowledge(stream_id, length)
            await self._flush()
        await upstream.send(h11.EndOfMessage(headers=self._trailers.pop(stream_id, [])))

    async def _download(
        self,
        stream_id: int,
        upstream: _Upstream,
        request: h11.Request,
        upload: asyncio.Future[None],
    ) -> tuple[bytes, bool] | None:
        """The server's response to the guest. A body framed by length alone, once the
        request's has gone, goes on as raw bytes: then what the server sent past it, and
        whether its connection may serve another request."""
        while True:
            event = await upstream.next_event()
            if isinstance(event, h11.InformationalResponse):
                continue  # 1xx: nothing HTTP/2 needs from them here
            if isinstance(event, h11.Response):
                fields = [
                    (n.lower(), v)
                    for n, v in event.headers.raw_items()
                    if n.lower().decode() not in _HOP
                ]
                self._h2.send_headers(stream_id, [(b":status", b"%d" % event.status_code), *fields])
                await self._flush()
                length = raw_length(request, event) if upload.done() else None
                if length is not None:
                    send = partial(self._send, stream_id)
                    leftover = await splice(upstream.h11, upstream.stream, send, length)
                    self._h2.end_stream(stream_id)
                    await self._flush()
                    return leftover, not (closes(request.headers) or closes(event.headers))
            elif isinstance(event, h11.Data):
                await self._send(stream_id, bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if trailers := [(n.lower(), v) for n, v in event.headers.raw_items()]:
                    self._h2.send_headers(stream_id, trailers, end_stream=True)
                else:
                    self._h2.end_stream(stream_id)
                await self._flush()
                return None
            else:
                raise ConnectionError("response cut short")

    async def _send(self, stream_id: int, data: bytes) -> None:
        """`data` on the stream, as the guest's windows allow: as many frames as the window
        takes, then one write (one TLS write and one send for them all, not one a frame)."""
        view = memoryview(data)
        while view:
            window = self._h2.local_flow_control_window(stream_id)
            if window <= 0:
                self._window.clear()
                await self._window.wait()
                continue
            view = send_within_window(self._h2, stream_id, view)
            await self._flush()
