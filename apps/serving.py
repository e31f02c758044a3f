"""Concurrent callers served from one running batch (the RAG web app's requests)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future

from specsuite.core.engine import BatchEngine, Request


class BatchServer:
    """One running batch for concurrent callers (a web app's requests): `submit` from any thread
    returns a Future; a request joins the batch at the next step instead of waiting for the
    others to finish. The engine runs in a daemon thread, started on the first request."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self._queue: queue.Queue[tuple[Request, Future]] = queue.Queue()
        self._futures: list[Future] = []  # by request number
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, request: Request) -> Future:
        future: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="specsuite-batch", daemon=True)
                self._thread.start()
        self._queue.put((request, future))
        return future

    def _requests(self) -> Iterator[Request | None]:
        while True:
            try:  # block only while nothing is decoding
                request, future = self._queue.get(block=self.engine.in_flight == 0)
            except queue.Empty:
                yield None
                continue
            self._futures.append(future)
            yield request

    def _serve(self) -> None:
        try:
            for index, result in self.engine.run(self._requests()):
                future = self._futures[index]
                self._futures[index] = None  # type: ignore[call-overload] - done: drop the reference
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
        except BaseException as e:  # the batch itself failed: fail its callers, restart on the next request
            with self._lock:
                self._thread = None
                waiting, self._futures = [f for f in self._futures if f is not None], []
            for future in waiting:
                future.set_exception(e)
            raise
