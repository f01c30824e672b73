"""Stage-by-stage progress on stderr, so a long align run shows where it is and how long each step took."""

import sys
import time
from contextlib import contextmanager


class Progress:
    def __init__(self, total: int, stream=None):
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    @contextmanager
    def stage(self, what: str):
        self.done += 1
        t0 = time.perf_counter()
        print(f"[{self.done}/{self.total}] {what} ...", file=self.stream, flush=True)
        yield
        print(f"[{self.done}/{self.total}] {what}: done in {time.perf_counter() - t0:.1f} s "
              f"(total {time.perf_counter() - self.start:.0f} s)", file=self.stream, flush=True)
