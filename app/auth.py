"""Optional login for the page and the API (``--auth``), for share links and open hosts.

    --auth alice:s3cret          one user
    --auth ./users.txt           a file, one ``user:password`` per line (# comments allowed)

The page uses Gradio's login form. API clients send either HTTP Basic credentials or the
password as a bearer token (what the OpenAI SDK sends as ``api_key``). Only ``/health``'s
readiness stays open, so a load balancer or a Space can probe it; the rest of ``/health``
(model paths, start-up errors), ``/metrics`` (hostnames, worker pids), ``/docs`` and
``/openapi.json`` need a login.

Guessing is throttled per client address (``LoginThrottle``): after ``login_failures_max``
wrong logins within ``login_failures_window_s`` — the page's form, Basic or Bearer alike —
that address's attempts get 429 with Retry-After. A correct login is never delayed.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBasic, HTTPBearer

from workers.errors import AuthError

Credentials = list[tuple[str, str]]


def parse_auth(value: str) -> Credentials:
    path = Path(value).expanduser()
    lines = path.read_text().splitlines() if path.is_file() else [value]
    creds = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise AuthError("--auth wants user:password (or a file of such lines)")
        creds.append((user, password))
    if not creds:
        raise AuthError(f"--auth file {path} has no user:password line")
    return creds


def check_login(creds: Credentials, user: str, password: str) -> bool:
    """Constant-time comparison, so timing does not reveal how much of a password matched."""
    ok = False
    for u, p in creds:
        ok |= secrets.compare_digest(u.encode(), user.encode()) & secrets.compare_digest(p.encode(), password.encode())
    return ok


async def authenticate(creds: Credentials, request: Request) -> str | None:
    """The user a request's credentials belong to (Basic user:password, or ``Bearer <password>``,
    read with ``fastapi.security``'s schemes, which also put them in the OpenAPI docs); None
    without valid ones."""
    scheme = request.headers.get("authorization", "").partition(" ")[0].lower()
    if scheme == "basic":
        try:
            login = await HTTPBasic(auto_error=False)(request)
        except HTTPException:  # not base64 user:password
            login = None
        if login and check_login(creds, login.username, login.password):
            return login.username
    elif scheme == "bearer":
        token = await HTTPBearer(auto_error=False)(request)
        if token:
            return next((user for user, _ in creds if check_login(creds, user, token.credentials)), None)
    return None


class LoginThrottle:
    """Wrong logins per client address. Once an address has ``max_failures`` within ``window_s``,
    every attempt from it is refused (429) until the oldest of them leaves the window — right
    or wrong: a throttle that let a right guess through would still answer every guess. So an
    address guesses at most ``max_failures`` passwords per window; others are not affected.
    The address is uvicorn's ``client``: the peer, or what a proxy listed in
    ``--forwarded-allow-ips`` forwards (nobody else can choose it with a header)."""

    MAX_ADDRESSES = 10_000  # addresses tracked at once, the stalest dropped first: memory stays bounded

    def __init__(self, max_failures: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures, self.window_s, self.clock = max_failures, window_s, clock
        self.failures: dict[str, deque[float]] = {}  # in order of the latest failure

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until ``address`` may try again; None if it may now."""
        times = self.failures.get(address)
        if not times or len(times) < self.max_failures:
            return None
        wait = times[0] + self.window_s - self.clock()
        if wait <= 0:
            return None
        return math.ceil(wait)

    def failed(self, address: str) -> None:
        times = self.failures.pop(address, None) or deque(maxlen=self.max_failures)
        times.append(self.clock())
        self.failures[address] = times
        if len(self.failures) > self.MAX_ADDRESSES:
            del self.failures[next(iter(self.failures))]

    def refusal(self, address: str) -> HTTPException | None:
        wait = self.retry_after(address)
        if wait is None:
            return None
        return HTTPException(429, f"Too many failed logins from your address ({address}); try again in {wait} s.",
                             headers={"Retry-After": str(wait)})


def client_address(request_or_scope) -> str:
    client = request_or_scope.get("client") if isinstance(request_or_scope, dict) else request_or_scope.client
    return client[0] if client else "unknown"


@dataclass
class Login:
    """``--auth``'s credentials and the throttle on guessing them."""

    creds: Credentials
    throttle: LoginThrottle

    async def user(self, request: Request) -> str | None:
        """The user the request's credentials belong to; None without credentials, or with wrong
        ones (which count against its address); a 429 while its address is throttled."""
        if not request.headers.get("authorization"):
            return None
        address = client_address(request)
        if refused := self.throttle.refusal(address):
            raise refused
        user = await authenticate(self.creds, request)
        if user is None:
            self.throttle.failed(address)
        return user


class PageLoginThrottle:
    """ASGI middleware: Gradio's own login form (``POST /login``) under the same throttle. A
    throttled address gets the 429 before Gradio reads the form; Gradio's 400 (wrong
    credentials) counts as a failure."""

    def __init__(self, app, login: Login, path: str = "/login") -> None:
        self.app, self.login, self.path = app, login, path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != self.path:
            return await self.app(scope, receive, send)
        address = client_address(scope)
        if refused := self.login.throttle.refusal(address):
            response = JSONResponse({"detail": refused.detail}, status_code=429, headers=refused.headers)
            return await response(scope, receive, send)

        async def watched(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 400:
                self.login.throttle.failed(address)
            await send(message)

        await self.app(scope, receive, watched)


def caller_scope(login: Login | None):
    """A FastAPI dependency naming whose conversations a request may reuse
    (``workers.generation.conversations``): the user, with ``--auth`` (else a 401, or a 429
    while throttled); without, the client's own address (a proxy in front makes its clients
    one scope, unless ``--forwarded-allow-ips`` trusts it to name them). Also the login check of
    ``/metrics`` and the docs."""

    async def scope(request: Request) -> str:
        if login is None:
            return f"client:{client_address(request)}"
        user = await login.user(request)
        if user is None:
            raise HTTPException(401, "Authentication required: send your --auth credentials "
                                     "(HTTP Basic, or the password as a bearer token).",
                                headers={"WWW-Authenticate": 'Basic realm="cpu-chat"'})
        return f"user:{user}"

    return scope
