"""Optional login for the page and the API (``--auth``), for share links and open hosts.

    --auth alice:s3cret          one user
    --auth ./users.txt           a file, one ``user:password`` per line (# comments allowed)

The page uses Gradio's login form. API clients send either HTTP Basic credentials or the
password as a bearer token (what the OpenAI SDK sends as ``api_key``), or in ``x-api-key`` (what
Anthropic's SDK sends), which counts as a bearer token. Only ``/health``'s
readiness stays open, so a load balancer or a Space can probe it; the rest of ``/health``
(model paths, start-up errors), ``/metrics`` (hostnames, worker pids), ``/docs`` and
``/openapi.json`` need a login.

Guessing is throttled (``LoginThrottle``) per client address *and* user name, not per address
alone: behind the share tunnel (or a proxy on this host) every visitor is 127.0.0.1, and one
guesser must not lock everyone out. After ``login_failures_max`` wrong logins at one name from
one address within ``login_failures_window_s`` — the page's form, Basic or Bearer alike (a
bearer token names no user: bearer tokens count as one name of their own) — attempts at that
name from that address get 429 with Retry-After, while another user logging in from the same
address is not delayed. Looser bounds catch the rest: one name guessed from many addresses,
and one address of its own guessing at many names.
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


@dataclass(frozen=True)
class Offered:
    """The credentials a request carries: a user name (``BEARER`` for a bearer token, which
    names none; "" when the header cannot be read) and a password."""

    name: str | None
    password: str


async def offered(request: Request) -> Offered:
    """What the request's Authorization header offers: Basic user:password, or
    ``Bearer <password>``, read with ``fastapi.security``'s schemes (which also put them in the
    OpenAPI docs)."""
    scheme = request.headers.get("authorization", "").partition(" ")[0].lower()
    if scheme == "basic":
        try:
            login = await HTTPBasic(auto_error=False)(request)
        except HTTPException:  # not base64 user:password
            login = None
        return Offered(login.username, login.password) if login else Offered("", "")
    if scheme == "bearer":
        token = await HTTPBearer(auto_error=False)(request)
        return Offered(BEARER, token.credentials if token else "")
    if key := request.headers.get(API_KEY_HEADER):  # what Anthropic's SDK sends as its api_key: a bearer token
        return Offered(BEARER, key)
    return Offered("", "")


def whose(creds: Credentials, offer: Offered) -> str | None:
    """The user the offered credentials belong to; None if they are wrong."""
    if offer.name is BEARER:
        return next((user for user, _ in creds if offer.password and check_login(creds, user, offer.password)), None)
    return offer.name if check_login(creds, offer.name, offer.password) else None


BEARER = None  # the user name of a bearer token's login: it names none
API_KEY_HEADER = "x-api-key"  # Anthropic's clients' header for the key: the password, as a bearer token


class Failures:
    """The times of the latest wrong logins per key, at most ``bound`` each, within ``window_s``."""

    MAX_KEYS = 10_000  # keys tracked at once, the stalest dropped first: memory stays bounded

    def __init__(self, bound: int, window_s: float) -> None:
        self.bound, self.window_s = bound, window_s
        self._times: dict[object, deque[float]] = {}  # in order of the latest failure

    def wait(self, key: object, now: float) -> int | None:
        """Whole seconds until ``key`` is below its bound again; None if it is now."""
        times = self._times.get(key)
        if not times or len(times) < self.bound or (wait := times[0] + self.window_s - now) <= 0:
            return None
        return math.ceil(wait)

    def add(self, key: object, now: float) -> None:
        times = self._times.pop(key, None) or deque(maxlen=self.bound)
        times.append(now)
        self._times[key] = times
        if len(self._times) > self.MAX_KEYS:
            del self._times[next(iter(self._times))]


class LoginThrottle:
    """Wrong logins per (client address, user name), with looser bounds per name and per address.

    Once a key has its bound of failures within ``window_s``, every attempt under it is refused
    (429) until the oldest leaves the window — right or wrong: a throttle that let a right
    guess through would still answer every guess. The keys, each with its own bound:

    - (address, name), ``max_failures``: a guesser slows only its own guesses at that name;
      someone else logging in from the same address (everyone, behind the share tunnel) as
      another user is not delayed. The user it guesses at is, from that address: what the
      tunnel cannot tell apart, no throttle can.
    - name, ``NAME_BOUND`` × ``max_failures``, from every address together: one name guessed
      from many addresses. An address locked at a name adds no more, so one address alone
      (the tunnel) never locks a name for the others.
    - address, ``ADDRESS_BOUND`` × ``max_failures``, at any names: spraying guesses across
      names — except from ``SHARED`` addresses, which stand for many people.

    A bearer token names no user, so bearer logins count as one name of their own (``BEARER``):
    a bearer guesser slows bearer logins from its address, not logins by name.
    The address is uvicorn's ``client``: the peer, or what a proxy listed in
    ``--forwarded-allow-ips`` forwards (nobody else can choose it with a header)."""

    NAME_BOUND = 5
    ADDRESS_BOUND = 5
    # Where the share tunnel and a reverse proxy on this host connect from: many people at once.
    SHARED = frozenset({"127.0.0.1", "::1"})
    MAX_NAME = 256  # characters of a user name kept as a key: longer ones cannot hold memory hostage

    def __init__(self, max_failures: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.pairs = Failures(max_failures, window_s)
        self.names = Failures(self.NAME_BOUND * max_failures, window_s)
        self.addresses = Failures(self.ADDRESS_BOUND * max_failures, window_s)

    def _keys(self, address: str, name: str | None) -> list[tuple[Failures, object, str]]:
        """Each bound that applies to an attempt, its key, and what the refusal says."""
        name = name if name is BEARER else name[: self.MAX_NAME]
        who = "bearer tokens" if name is BEARER else f"the user name {name[:64]!r}"
        keys = [(self.pairs, (address, name), f"for {who} from your address ({address})"),
                (self.names, name, f"for {who} from many addresses")]
        if address not in self.SHARED:
            keys.append((self.addresses, address, f"from your address ({address})"))
        return keys

    def failed(self, address: str, name: str | None) -> None:
        """A wrong login at ``name`` (``BEARER``: a bearer token) from ``address``."""
        now = self.clock()
        for failures, key, _ in self._keys(address, name):
            failures.add(key, now)

    def refusal(self, address: str, name: str | None) -> HTTPException | None:
        """The 429 for an attempt under a bound that is full (the longest wait, if several)."""
        now = self.clock()
        waits = [(wait, why) for failures, key, why in self._keys(address, name)
                 if (wait := failures.wait(key, now)) is not None]
        if not waits:
            return None
        wait, why = max(waits, key=lambda w: w[0])
        return HTTPException(429, f"Too many failed logins {why}; try again in {wait} s.",
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
        ones (which count against its address and the name they offer); a 429 while those are
        throttled."""
        if not request.headers.get("authorization") and not request.headers.get(API_KEY_HEADER):
            return None
        address, offer = client_address(request), await offered(request)
        if refused := self.throttle.refusal(address, offer.name):
            raise refused
        user = whose(self.creds, offer)
        if user is None:
            self.throttle.failed(address, offer.name)
        return user


class PageLoginThrottle:
    """ASGI middleware: Gradio's own login form (``POST /login``) under the same throttle. The
    form is read here first, for the user name it tries (as Gradio reads it: stripped), then
    handed to Gradio unchanged; a throttled attempt gets the 429 before Gradio sees it, and
    Gradio's 400 (wrong credentials) counts as a failure."""

    MAX_FORM_BYTES = 64 * 1024  # a login form is a name and a password

    def __init__(self, app, login: Login, path: str = "/login") -> None:
        self.app, self.login, self.path = app, login, path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != self.path:
            return await self.app(scope, receive, send)
        body = await read_body(receive, self.MAX_FORM_BYTES)
        if body is None:
            response = JSONResponse({"detail": f"A login form is at most {self.MAX_FORM_BYTES // 1024} KiB."},
                                    status_code=413)
            return await response(scope, receive, send)
        address, name = client_address(scope), await form_user_name(scope, body)
        if refused := self.login.throttle.refusal(address, name):
            response = JSONResponse({"detail": refused.detail}, status_code=429, headers=refused.headers)
            return await response(scope, receive, send)

        async def watched(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 400:
                self.login.throttle.failed(address, name)
            await send(message)

        await self.app(scope, replaying(body, receive), watched)


async def read_body(receive, limit: int) -> bytes | None:
    """The whole request body; None once it passes ``limit`` bytes."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: what came is all there is
            return body
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return body


def replaying(body: bytes, receive):
    """An ASGI ``receive`` that yields ``body`` again, then whatever ``receive`` says next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def form_user_name(scope, body: bytes) -> str:
    """The ``username`` field of a login form (urlencoded or multipart), stripped as Gradio
    strips it; "" when there is none or the form cannot be read (Gradio then refuses it)."""

    async def nothing_more():
        return {"type": "http.disconnect"}

    try:
        form = await Request(scope, replaying(body, nothing_more)).form()
    except Exception:  # noqa: BLE001 - a malformed form: Gradio answers it, the name is ""
        return ""
    name = form.get("username")
    await form.close()
    return name.strip() if isinstance(name, str) else ""


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
