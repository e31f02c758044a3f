"""Streaming a generation as text, marking which pieces came from accepted drafts (for the UIs)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from .generate import Generation


@dataclass
class TextPiece:
    text: str
    from_draft: bool  # accepted from a draft (True) or picked by the target itself


class TextAssembler:
    """Turns token groups into text pieces; holds back an incomplete multi-byte character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""

    def push(self, tokens: list[int], from_draft: list[bool]) -> list[TextPiece]:
        pieces = []
        # Tokens of one origin are decoded together; an origin change starts a new piece.
        start = 0
        for i in range(1, len(tokens) + 1):
            if i == len(tokens) or from_draft[i] != from_draft[start]:
                self.tokens += tokens[start:i]
                text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip)
                if not text.endswith("\ufffd") and len(text) > len(self.text) and text.startswith(self.text):
                    pieces.append(TextPiece(text[len(self.text):], from_draft[start]))
                    self.text = text
                start = i
        return pieces


class StreamClosed(Exception):
    """Raised inside the generation of a stream its consumer closed early, to end it."""


def stream(run: Callable[..., Generation], tokenizer, **kwargs) -> Iterator[TextPiece | Generation]:
    """Run `run(on_step=..., **kwargs)` (e.g. `functools.partial(generate, model, ids, drafter)`) in
    a thread; yield TextPieces as steps are accepted, then the final Generation.

    Closing the iterator early (a client gone, a time budget spent) ends the generation after
    its current step; close() does not wait for that, as Gradio closes iterators in its event loop."""
    q: queue.Queue = queue.Queue()
    assembler = TextAssembler(tokenizer)
    done = object()
    result: dict = {}
    closed = threading.Event()

    def on_step(tokens: list[int], flags: list[bool]) -> None:
        if closed.is_set():  # nobody reads on: free the model instead of decoding to the end
            raise StreamClosed("the stream was closed")
        for piece in assembler.push(tokens, flags):
            q.put(piece)

    def worker() -> None:
        try:
            result["generation"] = run(on_step=on_step, **kwargs)
        except BaseException as e:  # re-raised in the consumer's thread
            result["error"] = e
        finally:
            q.put(done)

    threading.Thread(target=worker, daemon=True).start()
    try:
        while (item := q.get()) is not done:
            yield item
    finally:
        closed.set()
    if "error" in result:
        raise result["error"]
    yield result["generation"]
