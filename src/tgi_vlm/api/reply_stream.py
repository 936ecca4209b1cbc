"""A tool-constrained reply read as it streams, turned into OpenAI `ChatCompletionChunk` deltas.

The grammar (api/tools.py) makes the text either `{"name": N, "arguments": ARGS}` or, under `auto`,
`{"content": TEXT}`. Nothing is sent until the text shows which (the first key). A call then sends
one delta with its role, id, type and name (`arguments: ""`) and, as ARGS grows, `arguments`
fragments: the generated JSON text itself, so the fragments concatenate to the non-streamed
`arguments`. Content sends its role with `content: ""` at once, then TEXT's characters once they
are decodable (a JSON escape is held until complete). A stream that ends before either sends its
role with `content: null` in the last chunk (`close`). So the deltas of any prefix of the text
reassemble to what `read_reply` makes of that prefix.
"""

from __future__ import annotations

import json

from tgi_vlm.api.tools import CALL_HEAD, CONTENT_HEAD, decodable, value_end


class ReplyStream:
    def __init__(self, call_id: str):
        self.call_id = call_id
        self.text = ""
        self.mode: str | None = None  # None until the first key is known, then "call" or "content"
        self.start = 0  # where ARGS or TEXT begins in `text`
        self.sent = 0  # characters of ARGS (call) or of raw TEXT (content) already sent
        self.called = False
        self.opened = False  # content's first delta (its role) sent

    def feed(self, piece: str) -> list[dict]:
        """The deltas `piece` makes sendable (often none)."""
        self.text += piece
        if self.mode is None and not self._decide():
            return []
        return self._call_deltas() if self.mode == "call" else self._content_deltas()

    def _decide(self) -> bool:
        call = CALL_HEAD.match(self.text)
        if call:
            self.mode, self.start, self.name = "call", call.end(), json.loads(f'"{call.group(1)}"')
            return True
        content = CONTENT_HEAD.match(self.text)
        if content:
            self.mode, self.start = "content", content.end()
        return content is not None

    def close(self) -> dict:
        """The last chunk's delta: the role, when nothing has carried it yet (the text showed neither
        a call nor content), else nothing."""
        return {"role": "assistant", "content": None} if self.mode is None else {}

    def _call_deltas(self) -> list[dict]:
        deltas = []
        if not self.called:
            self.called = True
            deltas.append({"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": ""}}]})
        while self.sent == 0 and self.text[self.start: self.start + 1] == " ":
            self.start += 1  # the head may have matched before the space the grammar allows after `:`
        end = value_end(self.text, self.start)
        upto = len(self.text) if end is None else end
        fragment = self.text[self.start + self.sent: upto]
        if fragment:
            self.sent += len(fragment)
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})
        return deltas

    def _content_deltas(self) -> list[dict]:
        ready = decodable(self.text[self.start:])
        piece = json.loads(f'"{self.text[self.start + self.sent: self.start + ready]}"') if ready > self.sent else ""
        if self.opened and not piece:
            return []
        self.opened, self.sent = True, max(ready, self.sent)
        return [{"role": "assistant", "content": piece}]  # the first one even when empty: it carries the role
