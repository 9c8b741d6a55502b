"""What a reply must look like, as a grammar the worker enforces while it samples.

``response_format`` asks for JSON: ``json_object`` (any object), ``json_schema`` in OpenAI's
shape (``{"json_schema": {"name", "schema", "strict"}}``), or llama.cpp's spelling, the schema
right in ``response_format.schema``. It becomes llguidance's grammar text here, in the API
process, so a schema that cannot be compiled is a 400 naming the field before any worker sees
it; the worker (``workers.generation.grammar``) masks each step's logits with it.

The JSON is written compact, with one space after ``,`` and ``:`` and no other whitespace
between tokens: a grammar that allows free whitespace lets a small model pad a reply with
newlines until ``max_tokens``, a failure several servers are known for. An object takes only
the properties its schema names unless the schema says otherwise (``closed_objects``).
``strict: true`` (as OpenAI's) refuses a schema with a keyword the compiler does not implement;
without it such a keyword is ignored, as a best effort.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.edge.errors import FieldError

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
OPEN_TO_OTHERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")  # what a schema says of them
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMAS = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=lambda: dict(ANY_OBJECT), alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema", description="llama.cpp's spelling: the schema, here")


def response_grammar(fmt: ResponseFormat | None) -> str:
    """The grammar a ``response_format`` asks for ("" for text); a 400 naming the field when
    it cannot be compiled."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and (fmt.schema_ is not None or fmt.json_schema is not None):
            raise FieldError("A text response_format takes no schema; use type json_schema "
                             "(field 'response_format.type').", "response_format.type")
        return ""
    if fmt.type == "json_object":
        return json_grammar(fmt.schema_ or ANY_OBJECT, strict=False, param="response_format.schema")
    if fmt.json_schema is not None:
        return json_grammar(fmt.json_schema.schema_, bool(fmt.json_schema.strict),
                            "response_format.json_schema.schema")
    if fmt.schema_ is not None:
        return json_grammar(fmt.schema_, strict=False, param="response_format.schema")
    raise FieldError("A json_schema response_format needs its json_schema: {\"name\": ..., \"schema\": {...}} "
                     "(field 'response_format.json_schema').", "response_format.json_schema")


def json_grammar(schema: dict, strict: bool, param: str) -> str:
    """llguidance's grammar for JSON matching ``schema``, laid out as ``JSON_LAYOUT`` whatever
    the schema's own ``x-guidance`` says; a 400 naming ``param`` if it cannot be compiled."""
    from llguidance import LLMatcher

    options = {**JSON_LAYOUT, "lenient": not strict}
    try:
        grammar = LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=options)
    except (ValueError, TypeError) as exc:
        raise FieldError(f"The schema cannot be used: {exc} (field '{param}').", param) from exc
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise FieldError(f"The schema cannot be used: {one_line(messages[0])} (field '{param}').", param)
    return grammar


def closed_objects(schema: object, close: bool = True) -> object:
    """``schema`` (not changed) with every object that names its properties, and says nothing of
    others, closed to others (``additionalProperties: false``), nested ones too.

    Why: by JSON Schema's letter such an object may hold any other key, and a small model uses
    that. Asked for ``name, country`` (the ``llm`` CLI's ``--schema``), the bundled model added a
    ``capital_city``; a tool's function then gets an argument it does not take. llama.cpp's
    server and vLLM's default backend close objects the same way; a schema that wants others
    says so. The parts of an ``allOf`` are left open (each names only some of the properties,
    so closing one would refuse the others'), and so is the object they make up; ``anyOf`` and
    ``oneOf`` are alternatives, each closed on its own."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(part) for name, part in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed_objects(part) for part in schema[key]]
    for key in SCHEMAS:
        if isinstance(schema.get(key), dict):
            out[key] = closed_objects(schema[key])
    if isinstance(schema.get("allOf"), list):
        out["allOf"] = [closed_objects(part, close=False) for part in schema["allOf"]]
    if close and "properties" in schema and "allOf" not in schema and not any(k in schema for k in OPEN_TO_OTHERS):
        out["additionalProperties"] = False
    return out


def one_line(message: str, limit: int = 300) -> str:
    """The compiler's message on one line (a regex error spans several), cut to ``limit``."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:limit] or "(no reason given)"
