"""A request body, read and validated the same way for every dialect.

At most ``MAX_REQUEST_BYTES`` are read (413 past that, before anything is parsed), and a body
that is not ``application/json`` gets a 415 before it is read: a web page may POST
``text/plain`` to 127.0.0.1 from any site without the browser asking first, but not JSON.
Decoding, validation and translation run off the event loop, one body at a time (``Lane``): a
megabytes-long history must not hold up the loop (the page, /health, everyone's streams) while
it is parsed. A field the dialect does not have gets a 400 naming it (``FieldError``), as
OpenAI answers; NaN or infinity a 400 naming the field; anything else out of range a 422
naming each field, as FastAPI's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from app.edge.errors import FieldError, invalid_fields
from app.edge.validation import MAX_REQUEST_BYTES, InvalidInput

Model = TypeVar("Model", bound=BaseModel)
Result = TypeVar("Result")


class Lane:
    """One thread for the edge's CPU work on bodies, taken in turn.

    Off the event loop, and one at a time: ``json.loads`` and pydantic's validation hold the GIL
    for the whole of a call (~6 ms for a 2 MiB history here), so the loop gets it back only
    between calls. Ten such bodies on ten threads (``asyncio.to_thread``) left the loop waiting
    behind several calls in a row: 60-100 ms on an idle Zen 5, 130 ms on a busy machine, a
    frozen /health and a stall in every stream. In one lane the loop waits for one call at most
    (~15 ms), and the bodies take as long in all as side by side.
    """

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="edge-lane")

    async def run(self, work: Callable[[], Result]) -> Result:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)


async def parse_body(lane: Lane, request: Request, model: type[Model], fields: str) -> Model:
    """The body as ``model``; ``fields`` says what the dialect takes, in the message an
    unknown field gets ("OpenAI's chat-completions fields and a few of its own")."""
    check_json_type(request.headers.get("content-type", ""))
    too_large = HTTPException(413, f"The request body is larger than {MAX_REQUEST_BYTES // 2**20} MiB; "
                                   "send a shorter conversation.")
    if int(request.headers.get("content-length") or 0) > MAX_REQUEST_BYTES:
        raise too_large
    raw = bytearray()
    try:
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_REQUEST_BYTES:
                raise too_large
    except ClientDisconnect as exc:  # gone, or cut off by the server's body timeout: no one reads this
        raise HTTPException(400, "The client stopped sending the request body.") from exc
    return await lane.run(lambda: decode(bytes(raw), model, fields))


async def parse_body_400(lane: Lane, request: Request, model: type[Model], fields: str) -> Model:
    """``parse_body``, with an out-of-range field a 400 naming it too: for the dialects whose
    APIs answer every bad request so (Anthropic's, Ollama's: they have no 422)."""
    try:
        return await parse_body(lane, request, model, fields)
    except RequestValidationError as exc:
        named, param, _ = invalid_fields(exc)
        raise FieldError(named, param or "body") from exc


async def translated(lane: Lane, work: Callable[[], Result]) -> Result:
    """``work()`` (a translation to the internal request: cleaning megabytes, maybe, and
    compiling a schema) off the event loop; what the model cannot take is a 400 saying why."""
    try:
        return await lane.run(work)
    except InvalidInput as exc:
        raise HTTPException(400, str(exc)) from exc


def check_json_type(content_type: str) -> None:
    """415 unless ``application/json`` (any case, a UTF-8 charset or none)."""
    media, *params = [part.strip().lower() for part in content_type.split(";")]
    charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
    if media != "application/json" or any(c not in ("utf-8", "utf8") for c in charsets):
        raise HTTPException(415, f"The request body must be JSON, sent with Content-Type: application/json "
                                 f"(got {content_type[:100]!r}).")


def decode(raw: bytes, model: type[Model], fields: str) -> Model:
    """Decode and validate by hand, so a body that is not UTF-8 JSON gets a message that says so."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"The request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON.") from exc
    except json.JSONDecodeError as exc:
        raise HTTPException(400, f"The request body is not valid JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        if named := [".".join(map(str, e["loc"])) for e in errors if e["type"] == "finite_number"]:
            raise FieldError(f"{' and '.join(named)} must be a finite number, not NaN or infinity "
                             f"(field '{named[0]}').", named[0]) from exc
        if unknown := [".".join(map(str, e["loc"])) for e in errors if e["type"] == "extra_forbidden"]:
            raise FieldError(f"Unrecognized request argument supplied: {', '.join(unknown)}. This server takes "
                             f"{fields} (its /docs lists them); remove it from the request (field '{unknown[0]}').",
                             unknown[0]) from exc
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from exc  # as FastAPI's


def inline_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with its ``$defs`` written in place, for the OpenAPI document
    (whose references resolve against the whole document, not this schema)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if (ref := node.get("$ref", "")).startswith("#/$defs/"):
                return inline({**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return inline(schema)


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's ``openapi_extra`` for a body read by hand: ``/docs`` shows the model all the same."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(model)}}}}
