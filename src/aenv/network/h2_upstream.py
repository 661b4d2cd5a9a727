"""A verified connection to a server that speaks HTTP/2 (it chose `h2` by ALPN), shared by the
streams of one guest connection that speaks HTTP/2 too (`interception_h2.Bridge`). Servers that
answer only HTTP/2 (gRPC: trailers, long-lived streams both ways) are reached stream for stream,
each guest stream one stream here, with the rules' headers set on its request.

The proxy is the client (h2's client state machine). Flow control runs end to end: the server's
DATA is acknowledged (its window given back) only once the guest's side took it, and the guest's
DATA is sent only within the server's windows, so the proxy holds at most a window per stream.
Server push is turned off in the settings the proxy sends (and refused if it comes anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from aenv.network.interception import Stream

# What a stream, and the connection, may receive before the guest has taken it: enough for a
# download not to wait on round trips, little enough that the proxy's memory stays small.
_STREAM_WINDOW = 1 << 20
_CONNECTION_WINDOW = 8 << 20
_DEFAULT_WINDOW = 65535

# A stream's events from the server: its response, data, trailers, end or reset.
Event = h2.events.Event


def send_within_window(
    h2c: h2.connection.H2Connection, stream_id: int, view: memoryview
) -> memoryview:
    """Queue as much of `view` on stream `stream_id` as its flow-control window takes, a frame
    at a time (the caller then writes them all at once); returns the rest."""
    frame = h2c.max_outbound_frame_size
    take = min(h2c.local_flow_control_window(stream_id), len(view))
    for start in range(0, take, frame):
        h2c.send_data(stream_id, view[start : min(start + frame, take)])
    return view[take:]


class Gone(ConnectionError):
    """The server's connection ended (closed, GOAWAY, or a protocol error) before the stream."""


class H2Upstream:
    """One HTTP/2 connection to the server over `stream` (TLS already verified)."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self._h2 = h2.connection.H2Connection(config)
        self._h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0,  # no pushed streams
            },
        )
        self._events: dict[int, asyncio.Queue[Event | None]] = {}
        # Set when a window opens, a setting changes or a stream ends: senders and openers wait.
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self.closed = False

    async def start(self) -> None:
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(_CONNECTION_WINDOW - _DEFAULT_WINDOW)
        await self._flush()
        self._reader = asyncio.ensure_future(self._read())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _flush(self) -> None:
        if data := self._h2.data_to_send():
            await self._stream.write(data)

    async def _read(self) -> None:
        try:
            while data := await self._stream.read():
                for event in self._h2.receive_data(data):
                    self._dispatch(event)
                await self._flush()
        except (h2.exceptions.ProtocolError, ssl.SSLError, OSError, ConnectionError):
            pass
        finally:
            self._gone()

    def _gone(self) -> None:
        self.closed = True
        for queue in self._events.values():
            queue.put_nowait(None)
        self._changed.set()

    def _dispatch(self, event: Event) -> None:
        stream_id = getattr(event, "stream_id", None)
        if isinstance(event, h2.events.PushedStreamReceived):
            assert event.pushed_stream_id is not None
            self._h2.reset_stream(event.pushed_stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
        elif isinstance(event, h2.events.ConnectionTerminated):
            # Streams the server took (up to last_stream_id) may still end; later ones never.
            self.closed = True
            last = event.last_stream_id or 0
            for sid, events in self._events.items():
                if sid > last:
                    events.put_nowait(None)
            self._changed.set()
        elif stream_id and (queue := self._events.get(stream_id)) is not None:
            queue.put_nowait(event)
            if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                self._changed.set()
        elif stream_id and isinstance(event, h2.events.DataReceived):
            # A stream already given up: its data must not hold the connection's window.
            assert event.flow_controlled_length is not None
            self._h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
        if isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._changed.set()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def request(self, headers: list[tuple[bytes, bytes]], end_stream: bool) -> int:
        """Open a stream with `headers` (its request), once the server's limit on streams in
        flight allows; its id."""
        while True:
            if self.closed:
                raise Gone("the server's connection ended")
            limit = self._h2.remote_settings.max_concurrent_streams
            if self._h2.open_outbound_streams < limit:
                break
            await self._wait()
        stream_id = self._h2.get_next_available_stream_id()
        self._events[stream_id] = asyncio.Queue()
        self._h2.send_headers(stream_id, headers, end_stream=end_stream)
        await self._flush()
        return stream_id

    async def next_event(self, stream_id: int) -> Event:
        """The stream's next event from the server; raises Gone if the connection ended."""
        event = await self._events[stream_id].get()
        if event is None:
            raise Gone("the server's connection ended")
        return event

    async def send_data(self, stream_id: int, data: bytes) -> None:
        """`data` on the stream, as the server's windows allow (all frames a window takes in
        one write)."""
        view = memoryview(data)
        while view:
            if self.closed:
                raise Gone("the server's connection ended")
            window = self._h2.local_flow_control_window(stream_id)
            if window <= 0:
                await self._wait()
                continue
            view = send_within_window(self._h2, stream_id, view)
            await self._flush()

    async def end(self, stream_id: int, trailers: list[tuple[bytes, bytes]]) -> None:
        """End the stream's request, with `trailers` if any."""
        if trailers:
            self._h2.send_headers(stream_id, trailers, end_stream=True)
        else:
            self._h2.end_stream(stream_id)
        await self._flush()

    async def acknowledge(self, stream_id: int, length: int) -> None:
        """The guest took `length` of the stream's data: the server may send as much again."""
        self._h2.acknowledge_received_data(length, stream_id)
        await self._flush()

    async def forget(self, stream_id: int, reset: bool) -> None:
        """The stream is done here; `reset` cancels it at the server if it is still open."""
        queue = self._events.pop(stream_id, None)
        if reset and not self.closed:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        # Data of the stream not yet taken goes back to the connection's window.
        while queue is not None and not queue.empty():
            event = queue.get_nowait()
            if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    self._h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
        self._changed.set()
        with contextlib.suppress(OSError, ConnectionError, ssl.SSLError):
            await self._flush()
