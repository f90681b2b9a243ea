"""The answer of OpenAI's Responses API: the response object and the events that stream it.

One `ResponseBuilder` per request takes the request's chunks as they come and keeps the output
items: a `message` with one `output_text` part for text, a `function_call` for each tool call (the
chat path's `ToolOutput` tells text from calls). Each step returns the events that a streaming
client gets (numbered by `sequence_number`); a non-streaming request ignores them and sends the
final `response()`. Items are written one at a time: an item is done before the next is added.

Event order: response.created, response.in_progress; for a reasoning model's reasoning (a
`reasoning` item with one `reasoning_text` part) output_item.added, content_part.added,
reasoning_text.delta..., reasoning_text.done, content_part.done, output_item.done; per message output_item.added,
content_part.added, output_text.delta..., output_text.done, content_part.done, output_item.done;
per call output_item.added, function_call_arguments.delta..., function_call_arguments.done,
output_item.done; then response.completed, response.incomplete (status "incomplete": the token
budget ran out) or response.failed (the request was aborted). An error mid-stream is an `error`
event, and the last.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from minisgl.entrypoints.openai.extensions.reasoning import ReasoningSplit
from minisgl.entrypoints.openai.logprobs_format import ChatLogprobs
from minisgl.entrypoints.openai.tools import ToolOutput
from minisgl.frontend.chunk import Chunk, TokenLogprob
from minisgl.frontend.errors import RequestError

JSONObject = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> JSONObject:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
        # SGLang's names of the same counts (chat's), which its clients read
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }


def _status(finish_reason: str) -> str:
    return {"length": "incomplete", "abort": "failed", "error": "failed"}.get(finish_reason, "completed")


@dataclass
class ResponseBuilder:
    """One response as its chunks arrive: its output items and the events that build them."""

    model: str
    settings: JSONObject  # the request's settings, repeated in the response object
    tools: ToolOutput | None = None  # None: the output is all text
    logprobs: bool = False
    split: ReasoningSplit | None = None  # a reasoning model's reasoning -> a reasoning item
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[JSONObject] = field(default_factory=list)
    status: str = "in_progress"
    usage: JSONObject | None = None
    _open: JSONObject | None = None  # the item being written (the last of `output`)
    _finish_reason: str | None = None
    _error: RequestError | None = None  # why the output failed (finish_reason "error")
    _seq: int = 0

    def start(self) -> list[JSONObject]:
        """The first two events."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, chunk: Chunk) -> list[JSONObject]:
        """The events of one chunk (its text, or its tool calls)."""
        self._error = chunk.error or self._error
        return self._apply(self._parts(chunk), chunk.logprobs if self.tools is None else [])

    def complete(self, usage: JSONObject) -> list[JSONObject]:
        """The last events: the open item done (an empty message if nothing was written), then
        response.completed, .incomplete or .failed (after an error event if the output failed)."""
        events = [] if self._finish_reason is not None else self._apply(self._finish("abort"), [])
        if not any(item["type"] != "reasoning" for item in self.output):
            events += self._open_message()
        events += self._close("incomplete" if self._finish_reason in ("length", "error") else "completed")
        self.status, self.usage = _status(self._finish_reason or "abort"), usage
        if self._error is not None:  # the output could not go on: why, before response.failed
            events.append(self.error(self._error))
        return events + [self._event(f"response.{self.status}", response=self.response())]

    def error(self, e: RequestError) -> JSONObject:
        """The event of an error: the one that ends a stream that failed, or that precedes
        response.failed when the output could not go on."""
        return self._event("error", code=e.type, message=e.message, param=e.param)

    def response(self) -> JSONObject:
        out: JSONObject = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": copy.deepcopy(self.output),
            "error": None,
            "incomplete_details": None,
            "usage": self.usage,
            **self.settings,
        }
        if self.status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        elif self.status == "failed" and self._error is not None:
            out["error"] = {"code": self._error.type, "message": self._error.message}
        elif self.status == "failed":
            message = "the request was aborted (the server is stopping, or a worker failed)"
            out["error"] = {"code": "server_error", "message": message}
        if self.status not in ("in_progress", "failed"):
            out["completed_at"] = int(time.time())
        return out

    # ---- the output items -------------------------------------------------------------------------

    def _apply(self, parts: list[JSONObject], logprobs: list[TokenLogprob]) -> list[JSONObject]:
        events: list[JSONObject] = []
        for part in parts:
            if "reasoning" in part:
                events += self._reasoning(part["reasoning"])
            if "content" in part:
                events += self._text(part["content"], logprobs)
            for call in part.get("tool_calls", []):
                events += self._call(call)
        return events

    def _parts(self, chunk: Chunk) -> list[JSONObject]:
        """The chunk as chat deltas: {"reasoning"}, {"content"} and {"tool_calls"}."""
        text, reasoning = chunk.text, ""
        if self.split is not None:
            reasoning, text = self.split.feed(chunk.text, chunk.reasoning)
            if chunk.finish_reason is not None:
                more_reasoning, more_text = self.split.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        parts: list[JSONObject] = [{"reasoning": reasoning}] if reasoning else []
        if self.tools is None:
            parts += [{"content": text}] if text or chunk.logprobs else []
            if chunk.finish_reason is not None:
                self._finish_reason = chunk.finish_reason
            return parts
        parts += self.tools.feed(text)
        if chunk.finish_reason is not None:
            parts += self._finish(chunk.finish_reason)
        return parts

    def _finish(self, finish_reason: str) -> list[JSONObject]:
        if self.tools is None:
            self._finish_reason = finish_reason
            return []
        parts, self._finish_reason = self.tools.finish(finish_reason)
        return parts

    def _text(self, delta: str, logprobs: list[TokenLogprob]) -> list[JSONObject]:
        events = [] if self._open is not None and self._open["type"] == "message" else self._open_message()
        part = self._open["content"][0]  # type: ignore[index]
        part["text"] += delta
        lp = (ChatLogprobs().of(logprobs) or {}).get("content", []) if self.logprobs else []
        if self.logprobs:
            part["logprobs"] += lp
        return events + [self._event("response.output_text.delta", **self._where(), delta=delta, logprobs=lp)]

    def _reasoning(self, delta: str) -> list[JSONObject]:
        """More of the reasoning item (opened first if it is not the open item)."""
        events: list[JSONObject] = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close()
            item: JSONObject = {
                "id": _id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
                "content": [],
            }
            events += self._add(item)
            part: JSONObject = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            events.append(
                self._event("response.content_part.added", **self._where(), part=copy.deepcopy(part))
            )
        assert self._open is not None
        self._open["content"][0]["text"] += delta
        return events + [self._event("response.reasoning_text.delta", **self._where(), delta=delta)]

    def _open_message(self) -> list[JSONObject]:
        events = self._close()
        part: JSONObject = {"type": "output_text", "text": "", "annotations": []}
        if self.logprobs:
            part["logprobs"] = []
        item: JSONObject = {
            "id": _id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        events += self._add(item)
        item["content"].append(part)
        return events + [
            self._event("response.content_part.added", **self._where(), part=copy.deepcopy(part))
        ]

    def _call(self, call: JSONObject) -> list[JSONObject]:
        """A chat tool-call delta: a new call (it has an id) or more of the open call's arguments."""
        fn = call.get("function", {})
        events: list[JSONObject] = []
        if "id" in call:
            events += self._close()
            new = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"]}
            events += self._add({**new, "name": fn.get("name", ""), "arguments": ""})
        delta, item = fn.get("arguments", ""), self._open
        if not delta or item is None:
            return events
        item["arguments"] += delta
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return events + [self._event("response.function_call_arguments.delta", **where, delta=delta)]

    def _add(self, item: JSONObject) -> list[JSONObject]:
        self.output.append(item)
        self._open = item
        return [
            self._event(
                "response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item)
            )
        ]

    def _close(self, status: str = "completed") -> list[JSONObject]:
        """The events that finish the open item (none if no item is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = status
        events: list[JSONObject] = []
        if item["type"] == "reasoning":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self._event("response.reasoning_text.done", **where, text=part["text"]))
            events.append(self._event("response.content_part.done", **where, part=copy.deepcopy(part)))
        elif item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            lp = part.get("logprobs", [])
            events.append(self._event("response.output_text.done", **where, text=part["text"], logprobs=lp))
            events.append(self._event("response.content_part.done", **where, part=copy.deepcopy(part)))
        else:
            where = {"item_id": item["id"], "output_index": index}
            events.append(
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            )
        return events + [
            self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))
        ]

    def _where(self) -> JSONObject:
        """Where the open message's text is."""
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> JSONObject:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}
