"""A reasoning model's answer split into its reasoning (`<think>...</think>`, which goes to
`reasoning_content` and `reasoning`) and its content, as it streams.

Where the answer starts is the tokenizer worker's verdict on the prompt (minisgl.tokenizer.
reasoning): "inside" the reasoning (the prompt opened it; a `<think>` the model writes anyway is
dropped), "optional" (reasoning iff the answer opens with `<think>`), "off" or "" (all content).
The markers and the whitespace around them are not part of either text; a reasoning cut short
(max_tokens) stays reasoning. Tool calls are parsed from the content only: a `<tool_call>` inside
the reasoning is not a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.tokenizer.reasoning import THINK_END, THINK_START


@dataclass
class ReasoningSplit:
    """One choice's text as (reasoning, content) deltas: `feed` what can be sent now, `finish` the
    rest. The mode is taken from the first `feed` (see the module docstring)."""

    _state: str = ""  # "" (mode not known yet), "start", "reasoning", "content"
    _inside: bool = False  # at "start": what the text is unless it opens with <think>
    _held: str = ""  # text not decided yet (a marker may begin in it)
    _lead: bool = True  # the current part has had no non-whitespace yet (stripped)
    reasoning: str = ""  # all of it so far
    content: str = ""
    reasoned: bool = False  # the answer has a reasoning part (even an empty one)

    def feed(self, text: str, mode: str) -> tuple[str, str]:
        if not self._state:
            self._inside = mode == "inside"
            self._state = "start" if mode in ("inside", "optional") else "content"
            self.reasoned, self._lead = self._inside, self._state == "start"
        self._held += text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        if not self._state:
            self._state, self._lead = "content", False
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        r, c = "", ""
        if self._state == "start":
            self._start(final)
        if self._state == "reasoning":
            r = self._reasoning(final)
        if self._state == "content":
            c, self._held = self._strip(self._held), ""
        self.reasoning += r
        self.content += c
        return r, c

    def _start(self, final: bool) -> None:
        """Decide whether the text opens with <think> (then it is dropped) once it can be told."""
        head = self._held.lstrip()
        if head.startswith(THINK_START):
            self._held, self._lead, self.reasoned = head[len(THINK_START) :], True, True
            self._state = "reasoning"
        elif final or not THINK_START.startswith(head):
            self._state = "reasoning" if self._inside else "content"
            self._lead = self._inside  # an answer without reasoning is passed on as it is

    def _reasoning(self, final: bool) -> str:
        at = self._held.find(THINK_END)
        if at >= 0:
            out = self._strip(self._held[:at]).rstrip()
            self._held, self._lead, self._state = self._held[at + len(THINK_END) :], True, "content"
            return out
        keep = 0 if final else _partial(self._held)
        text, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        text = self._strip(text)
        if not final:  # trailing whitespace may be the one before </think>: hold it
            body = text.rstrip()
            self._held, text = text[len(body) :] + self._held, body
        else:
            text = text.rstrip()
        return text

    def _strip(self, text: str) -> str:
        """`text` without the whitespace that opens its part."""
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        return text


def _partial(text: str) -> int:
    """How many trailing characters of `text` could begin `</think>`."""
    for n in range(min(len(text), len(THINK_END) - 1), 0, -1):
        if THINK_END.startswith(text[-n:]):
            return n
    return 0
