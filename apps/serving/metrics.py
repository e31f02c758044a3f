"""The server's counters, in Prometheus' text format at `/metrics`: requests by model and status,
places taken, tokens made and target forwards (their ratio: tokens per forward, what speculation
buys), and a latency histogram."""

from __future__ import annotations

import threading
from collections import Counter

LATENCY_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.tokens = self.forwards = self.prompt_tokens = 0
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, the last one +Inf
        self.latency_sum = 0.0

    def request(self, model: str, status: int, seconds: float, stats: dict | None = None) -> None:
        """One finished request: its model, HTTP status, time from arrival, and its generation's stats."""
        with self._lock:
            self.requests[(model, status)] += 1
            self.latency[next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))] += 1
            self.latency_sum += seconds
            if stats:
                self.tokens += int(stats.get("new_tokens", 0))
                self.forwards += int(stats.get("forward_passes", 0))
                self.prompt_tokens += int(stats.get("prompt_tokens", 0))

    def render(self, in_flight: int, capacity: int, batch_size: int) -> str:
        with self._lock:
            lines = ["# TYPE specsuite_requests_total counter"]
            lines += [f'specsuite_requests_total{{model="{m}",status="{s}"}} {n}' for (m, s), n in sorted(self.requests.items())]
            lines += ["# TYPE specsuite_requests_in_flight gauge", f"specsuite_requests_in_flight {in_flight}",
                      "# TYPE specsuite_request_capacity gauge", f"specsuite_request_capacity {capacity}",
                      "# TYPE specsuite_batch_size gauge", f"specsuite_batch_size {batch_size}",
                      "# TYPE specsuite_generated_tokens_total counter", f"specsuite_generated_tokens_total {self.tokens}",
                      "# TYPE specsuite_prompt_tokens_total counter", f"specsuite_prompt_tokens_total {self.prompt_tokens}",
                      "# TYPE specsuite_forward_passes_total counter", f"specsuite_forward_passes_total {self.forwards}",
                      "# TYPE specsuite_request_seconds histogram"]
            total = 0
            for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.latency):
                total += count
                lines.append(f'specsuite_request_seconds_bucket{{le="{bound}"}} {total}')
            lines += [f"specsuite_request_seconds_sum {self.latency_sum:.3f}", f"specsuite_request_seconds_count {total}"]
        return "\n".join(lines) + "\n"
