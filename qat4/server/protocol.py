"""The HTTP/1.1 protocol `qat4 serve` runs under uvicorn: httptools' parser where it is installed
(C, several times cheaper per streamed chunk than h11's pure Python, which at 64 streams is much of
the host's time), else h11's; either way a connection whose request line and headers have not all
arrived within HEADER_TIMEOUT_S of its opening or of its last answer is closed (a client that
trickles its headers in holds a connection open for nothing, as slowloris does)."""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed
    HttpToolsProtocol = None

HEADER_TIMEOUT_S = 10.0  # a request's line and headers must arrive within this long


class _HeaderTimeout:
    """The timer of HEADER_TIMEOUT_S, armed when a connection opens and after each answer,
    cancelled once a request's headers are in (by the parser's subclass below)."""

    _header_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._cancel()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

    def _cancel(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()


class H11HeaderTimeout(_HeaderTimeout, H11Protocol):
    """h11's protocol with the header timeout: h11 hands over a request once its headers are in."""

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_headers():
            self._cancel()


if HttpToolsProtocol is not None:
    class HttpToolsHeaderTimeout(_HeaderTimeout, HttpToolsProtocol):
        """httptools' protocol with the header timeout: its parser calls back when the headers are in."""

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._cancel()

    HeaderTimeoutProtocol = HttpToolsHeaderTimeout
else:
    HeaderTimeoutProtocol = H11HeaderTimeout
