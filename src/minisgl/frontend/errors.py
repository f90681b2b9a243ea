"""What an HTTP handler can be told by the engine client: a request the workers refused or could
not finish (`RequestError`, with the HTTP status and the field at fault), or no room (`Overloaded`)."""

from __future__ import annotations


class RequestError(Exception):
    """A request the workers rejected or could not finish; `status` is the HTTP status to answer
    with, `param` the request field at fault (None: not one field)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


class Overloaded(Exception):
    """More requests in flight than --max-queued-requests allows."""
