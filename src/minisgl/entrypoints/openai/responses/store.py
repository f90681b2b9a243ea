"""Responses kept for `previous_response_id` and `GET` / `DELETE /v1/responses/{id}`.

In memory, per server (each API server, and each restart, starts empty; --dp replicas share their
API server's), bounded: at most `max_responses` responses and `max_bytes` of their JSON, the oldest
dropped first. A response is kept unless its request said `store: false` (OpenAI's default is to
keep it), with the conversation it ended: the input items that led to it, those of the responses
before it included, then its output as items. The instructions are not part of it (OpenAI carries
them over neither).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

JSONObject = dict[str, Any]


@dataclass(frozen=True)
class StoredResponse:
    response: JSONObject  # as it was returned
    items: list[JSONObject]  # the conversation up to and with its output, as input items
    size: int  # bytes of JSON, counted against the store's bound


@dataclass
class ResponseStore:
    max_responses: int = 1024
    max_bytes: int = 64 * 2**20
    _kept: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def put(self, response: JSONObject, items: list[JSONObject]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(items, ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        self.delete(response["id"])
        self._kept[response["id"]] = StoredResponse(response, items, size)
        self._bytes += size
        while len(self._kept) > self.max_responses or self._bytes > self.max_bytes:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._kept.pop(response_id, None)
        if old is not None:
            self._bytes -= old.size
        return old is not None

    def __len__(self) -> int:
        return len(self._kept)


def output_items(output: list[JSONObject]) -> list[JSONObject]:
    """A response's output as input items of a next request: its messages and function calls (its
    reasoning is left out, as chat templates drop the reasoning of earlier turns)."""
    items: list[JSONObject] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item["type"] == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
    return items
