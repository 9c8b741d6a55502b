"""PLACEHOLDER: being written."""

from fastapi import APIRouter


def routes(edge) -> APIRouter:
    return APIRouter()
