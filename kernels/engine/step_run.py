"""A run of forward steps that the same requests ran with the same rows each (a decode batch that did not
change), shared by those requests: the capture store appends each such step to the run once, instead
of once per request.

Why: the store's `end_step` appended every request's row range of every step to its capture one by one
(a dict lookup, three checks and an append per request and step: ~2.5 ms a 16 x 64-token generate with
no engine, ~7 ms in the engine, a few percent of the native engine's decode). Between two changes of the
batch (a request joins, finishes, is taken, preempted or evicted; a weight update) every step gives each
request the same row range of a new step, so the store keeps one `StepRun` for that stretch and each
request holds only (the run, its row range, the run's first step it has not counted yet): appending a
step is one list append, whatever the batch size. A request's counters (`num_rows`, `nbytes`) and its
steps are brought up to date from the run when something reads them (`RequestCapture._settle`), with
the same integers and the same step list as the per-step appends gave.
"""

from operator import add


class StepRun:
    """The steps of one run, in order (each a `StepCapture`), and the bytes of one row of every key
    summed over the first k steps (`row_bytes[k]`), so a member's bytes are one subtraction."""

    __slots__ = ("steps", "row_bytes")

    def __init__(self):
        self.steps: list = []
        self.row_bytes: list = [0]

    def append(self, step) -> None:
        self.steps.append(step)
        self.row_bytes.append(self.row_bytes[-1] + step.site_bytes + step.route_bytes)


class RunState:
    """What the capture store knows of the batch its current run was made for: the layout (request ids,
    query start locations), each request's first position in the run's next step, the weights and
    the captures' membership version (`RequestCaptures.version`) the run holds under, the run itself and
    the rows one of its steps adds. A step extends the run only when all of these still hold, which is
    when the per-request path would append every member's same row range and change nothing else."""

    __slots__ = ("req_ids", "qsl", "next_starts", "lengths", "weights", "version", "run", "rows")

    def __init__(self, req_ids, qsl, starts, weights, version, run, rows):
        self.req_ids, self.qsl = list(req_ids), list(qsl)
        self.lengths = [b - a for a, b in zip(qsl, qsl[1:])]
        self.next_starts = list(map(add, starts, self.lengths))
        self.weights, self.version, self.run, self.rows = weights, version, run, rows

    def extends(self, layout, weights, version) -> bool:
        """Whether a step of `layout` continues this run (every comparison a C-level one over lists)."""
        return (version == self.version and layout.start_positions == self.next_starts
                and layout.query_start_loc == self.qsl and layout.req_ids == self.req_ids and weights == self.weights)

    def advance(self) -> None:
        """After a step of the run: each request's next first position."""
        self.next_starts = list(map(add, self.next_starts, self.lengths))  # C-level, not a Python loop
