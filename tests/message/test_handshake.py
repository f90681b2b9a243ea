"""Start-up status messages travel as JSON, never pickled; malformed bytes are a clear error."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from minisgl.utils.handshake import recv_status, send_status


def test_status_round_trip() -> None:
    a, b = mp.Pipe()
    send_status(a, "ready", {"max_seq_len": 8192, "eos_token_ids": [0, 2]})
    assert recv_status(b) == ("ready", {"max_seq_len": 8192, "eos_token_ids": [0, 2]})


def test_pickled_payload_is_refused_not_unpickled() -> None:
    a, b = mp.Pipe()
    a.send(("ready", {"x": 1}))  # what Connection.send would write: a pickle
    with pytest.raises(ValueError, match="malformed start-up status"):
        recv_status(b)
    a.send_bytes(b'[1, "x"]')
    with pytest.raises(ValueError, match="kind 1 is not a string"):
        recv_status(b)
