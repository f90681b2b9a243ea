"""Errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: `APIError` for what a
route refuses, and the app's handlers for validation errors, HTTP errors and anything unexpected
(a client's mistake is never a 500)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("minisgl.server")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}


def _printable(text: str) -> str:
    """`text` made encodable as UTF-8: a lone surrogate (from the client's JSON) becomes '\\udXXX'.
    An error message that echoes the client's input must not itself fail to be sent (a 500)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    code: str | int | None = None,
) -> JSONResponse:
    type_ = type_ or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {
        "error": {
            "message": _printable(message),
            "type": type_,
            "param": None if param is None else _printable(param),
            "code": _printable(code) if isinstance(code, str) else code if code is not None else status,
        }
    }
    return JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    kind = first.get("type", "value_error")
    if kind != "value_error":  # pydantic's own check: its error type too, as pydantic prints it (and
        msg += f" [type={kind}]"  # vLLM returns it; clients match e.g. "greater_than_equal")
    return (f"{param}: {msg}" if param else msg), param


async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_response(400, message, param=param)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = "no such route" if exc.status_code == 404 else str(exc.detail)
    return error_response(exc.status_code, message)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error: %s", exc)
    return error_response(500, f"internal server error: {type(exc).__name__}")


EXCEPTION_HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    RequestValidationError: _invalid_request,
    StarletteHTTPException: _http_error,
    APIError: _api_error,
    Exception: _internal_error,
}
