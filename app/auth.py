"""Optional login for the page and the API (``--auth``), for share links and open hosts.

    --auth alice:s3cret          one user
    --auth ./users.txt           a file, one ``user:password`` per line (# comments allowed)

The page uses Gradio's login form. API clients send either HTTP Basic credentials or the
password as a bearer token (what the OpenAI SDK sends as ``api_key``). Only ``/health``'s
readiness and ``/metrics`` stay open, so a load balancer or a Space can probe it; the rest
of ``/health`` (model paths, start-up errors), ``/docs`` and ``/openapi.json`` need a login.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fastapi import HTTPException, Request
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


def caller_scope(creds: Credentials | None):
    """A FastAPI dependency naming whose conversations a request may reuse
    (``workers.generation.conversations``): the user, with ``--auth`` (else a 401); without, the
    client's own address (a proxy in front makes its clients one scope)."""

    async def scope(request: Request) -> str:
        if creds is None:
            return f"client:{request.client.host if request.client else 'unknown'}"
        user = await authenticate(creds, request)
        if user is None:
            raise HTTPException(401, "Authentication required: send your --auth credentials "
                                     "(HTTP Basic, or the password as a bearer token).",
                                headers={"WWW-Authenticate": 'Basic realm="cpu-chat"'})
        return f"user:{user}"

    return scope
