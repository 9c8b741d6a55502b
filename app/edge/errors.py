"""Errors as OpenAI's clients read them: ``{"error": {"message", "type", "param", "code"}}``,
so the SDK's exception says why and names the field at fault, with FastAPI's ``detail``
kept beside it; another dialect's routes write them in its own shape (``shaped_errors``); and
the HTTP status for each kind of refusal a worker or the dispatcher sends.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from workers.protocol import ErrorCode, Failed

STATUS_FOR = {ErrorCode.INVALID_REQUEST: 400, ErrorCode.CONTEXT_LENGTH: 400, ErrorCode.BUSY: 503,
              ErrorCode.TOO_MANY: 429, ErrorCode.UNAVAILABLE: 503, ErrorCode.INTERNAL: 500}
RETRY_AFTER_S = {ErrorCode.BUSY: 5, ErrorCode.TOO_MANY: 5}  # tells a client when trying again makes sense
NAMED_FIELD = re.compile(r"\(field '([^']+)'\)")  # how a refusal's message names its field


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field, without echoing the input back (it may be huge, or unencodable)."""
    named, param, fields = invalid_fields(exc)
    return JSONResponse({"error": openai_error(named, 422, param), "detail": fields}, status_code=422)


def invalid_fields(exc: RequestValidationError) -> tuple[str, str | None, list[dict]]:
    """(a message naming each bad field, the first one's name, the fields as FastAPI lists them)."""
    fields = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
              for e in exc.errors()]
    named = "; ".join(f"{'.'.join(map(str, f['loc'][1:] or f['loc']))}: {f['msg']}" for f in fields)
    return named, ".".join(map(str, fields[0]["loc"][1:])) if fields else None, fields


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Errors in the shape OpenAI clients read (``{"error": {"message": ...}}``, so the SDK's
    exception says why), with FastAPI's ``detail`` kept beside it; ``param`` names the field
    at fault (``FieldError``)."""
    body = {"error": openai_error(str(exc.detail), exc.status_code, getattr(exc, "param", None),
                                  getattr(exc, "code", None)), "detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def openai_error(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """``code``: a refusal's own (``context_length_exceeded``), else the status."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
            415: "invalid_request_error", 421: "invalid_request_error", 422: "invalid_request_error",
            429: "rate_limit_error", 503: "server_busy"}.get(status, "server_error")
    return {"message": message, "type": kind, "param": param, "code": code or status}


ErrorShape = Callable[[str, int, "str | None", "str | None"], dict]  # (message, status, param, code) → body


def shaped_errors(shape: ErrorShape) -> type[APIRoute]:
    """A route class whose errors (a refusal, a bad field, a 401 from the login check) are
    written as ``shape`` makes them: each dialect's clients read their own error body
    (Anthropic's ``{"type": "error", ...}``, Ollama's ``{"error": "..."}``), not OpenAI's."""

    class Shaped(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def shaped(request: Request) -> Response:
                try:
                    return await handler(request)
                except HTTPException as exc:
                    body = shape(str(exc.detail), exc.status_code, getattr(exc, "param", None),
                                 getattr(exc, "code", None))
                    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
                except RequestValidationError as exc:
                    named, param, _ = invalid_fields(exc)
                    return JSONResponse(shape(named, 422, param, None), status_code=422)

            return shaped

    return Shaped


class FieldError(HTTPException):
    """A 400 about one field of the request: ``param`` names it in the error body, as OpenAI's
    errors do (``http_error``)."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(status, message)
        self.param = param


def refusal(failed: Failed) -> HTTPException:
    """The HTTP status for a worker's or the dispatcher's refusal; a field its message names
    (a ``logit_bias`` id outside the vocabulary) is the error's ``param``."""
    retry = RETRY_AFTER_S.get(failed.code)
    error = HTTPException(STATUS_FOR[failed.code], failed.message,
                          headers={"Retry-After": str(retry)} if retry else None)
    if failed.code is ErrorCode.INVALID_REQUEST and (named := NAMED_FIELD.search(failed.message)):
        error.param = named.group(1)
    if failed.code is ErrorCode.CONTEXT_LENGTH:
        error.code = failed.code.value  # what clients look for: OpenAI's code for a prompt past the window
    return error
