"""Start-up handshakes between the launcher and its children over a multiprocessing Pipe.

`Connection.send`/`recv` pickle their payload; the project promises that nothing arriving on a
socket is ever unpickled, so the status messages travel as JSON bytes instead.
"""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import Any


def send_status(conn: Connection, kind: str, payload: Any = None) -> None:
    """Send `(kind, payload)`; payload must be JSON-serialisable (dicts, lists, str, numbers)."""
    conn.send_bytes(json.dumps([kind, payload]).encode())


def recv_status(conn: Connection) -> tuple[str, Any]:
    """Receive one `(kind, payload)`; malformed bytes raise ValueError naming the problem."""
    raw = conn.recv_bytes()
    try:
        kind, payload = json.loads(raw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"malformed start-up status message ({len(raw)} bytes): {e}") from e
    if not isinstance(kind, str):
        raise ValueError(f"malformed start-up status message: kind {kind!r} is not a string")
    return kind, payload
