"""The two slime hooks that guide its Megatron forwards, and what they install on the model chunks.

slime calls
  before_log_prob_hook(args, model, store_prefix)     before each forward-only pass ("" : the actor's
                                                      log-probs; "ref_" / "teacher_": those models)
  before_train_step_hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)
                                                      before each training step.
Neither sees the data. The first call puts a forward pre-hook and a forward hook on each model chunk
(the module slime calls as `model(**forward_kwargs)`). The pre-hook takes the micro-batch's handles out
of the call's keyword arguments (handles.py), resolves them from the trainer's store
(trace_verl.records.RecordCache: handles of any other store are refused) and opens trace_verl's
`GuidedForward` on the GPTModel inside: the layout comes from the call's THD `packed_seq_params`, and
each record's identity is checked against its sample's tokens. The forward hook closes it and keeps
the micro-batch's metrics (metrics.py). Reference and teacher forwards run unguided (their weights are
not the rollout's): their handles are taken out and ignored.

Step end. slime's step is a rollout: the log-prob pass and every training step over its data. When the
actor's log-prob hook comes after training steps, or a training step of another rollout begins, the
records of the previous rollout are deleted from the store (by one rank per model-parallel group; the
others drop their copies). In slime's async mode the next rollout's records are made meanwhile: they
enter this cache only when its own forwards resolve them. The last rollout's records stay in the store.
"""

import logging

from trace_verl.guided import GuidedForward
from trace_verl.ranks import model_parallel_rank0
from trace_verl.records import RecordCache

from . import handles as H
from .metrics import micro_batch_metrics, phase_metrics
from .settings import ROLLOUT_HOW, TraceSlimeError, check_args

logger = logging.getLogger(__name__)


class SlimeGuidance:
    """One per trainer process: the hooks on slime's model chunks, the rollout's records, the metrics."""

    def __init__(self, trace):
        self.trace = trace
        self.records = RecordCache(owner=model_parallel_rank0(), allowed=[trace.store])
        self.guided = True
        self.phase: str | None = None  # "log_probs" / "train" while guided forwards run, None otherwise
        self.rollout_id = None  # the rollout whose records are cached (None: not known yet)
        self.trained = False  # a training step ran since the records were last ended
        self.micro_batches: list[dict] = []
        self.finished: dict[str, dict[str, float]] = {}  # the last finished phase's metrics, by phase
        self._chunks: set[int] = set()
        self._open = None

    # -- the hooks slime calls ----------------------------------------------------------------------
    def install(self, model) -> None:
        for chunk in model if isinstance(model, (list, tuple)) else [model]:
            if id(chunk) in self._chunks:
                continue
            chunk.register_forward_pre_hook(self._pre, with_kwargs=True)
            chunk.register_forward_hook(self._post, with_kwargs=True)
            self._chunks.add(id(chunk))

    def before_log_prob(self, args, store_prefix: str) -> None:
        self._finish(args)
        if store_prefix:
            self.guided, self.phase = False, None
            return
        if self.trained:
            self.end_step()
        self.guided, self.phase = True, "log_probs"

    def before_train_step(self, args, rollout_id) -> None:
        self._finish(args, rollout_id if self.phase == "log_probs" else self.rollout_id)
        if self.rollout_id is not None and rollout_id != self.rollout_id:
            self.end_step()
        self.rollout_id, self.trained = rollout_id, True
        self.guided, self.phase = True, "train"

    def end_step(self) -> None:
        # slime's step is the whole rollout (its log-prob pass and every training step over its data):
        # when it ends, all of its records are done, trained on or not.
        self.records.end_step(keep_untrained=False)
        self.rollout_id, self.trained = None, False

    # -- around each model call ---------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        if self._open is not None:  # the previous call raised inside the model
            self._open[0].__exit__(RuntimeError, None, None)
            self._open = None
        encoded = kwargs.pop(H.HANDLE_KEY, None)
        if encoded is None:
            raise TraceSlimeError(
                "TRACE on the trainer only: this micro-batch carries no record handles; the rollout must run "
                f"--custom-generate-function-path trace_slime.generate with {ROLLOUT_HOW}"
            )
        if not self.guided:
            return args, kwargs
        handles = H.decode(encoded)
        psp = kwargs.get("packed_seq_params")
        input_ids = kwargs.get("input_ids")
        if psp is None or input_ids is None:
            raise TraceSlimeError("trace_slime: slime called the model without input_ids / THD packed_seq_params")
        cu = psp.cu_seqlens_q.to("cpu").tolist()
        segments = len(cu) - 1
        # slime's get_batch pads the packed micro-batch to a multiple of its pad size with one more segment.
        if segments not in (len(handles), len(handles) + 1):
            raise TraceSlimeError(
                f"trace_slime: the packed micro-batch holds {segments} sequences, {len(handles)} handles came with it"
            )
        flat = input_ids.reshape(-1).to("cpu")
        if segments == len(handles) + 1 and bool(flat[cu[-2]:].any()):
            raise TraceSlimeError(
                f"trace_slime: {len(handles)} handles for {segments} packed sequences, and the last is not "
                "slime's zero padding: a sample of this micro-batch came without its handle"
            )
        records, resolve = self.records.resolve(handles, training=self.phase == "train")
        token_ids = [flat[cu[i]:cu[i + 1]] for i in range(segments)]
        guided = GuidedForward(module, records + [None] * (segments - len(handles)), token_ids)
        # Opened here, for the call this hook precedes (GuidedForward's own hooks would be registered
        # on a module already inside its call when the chunk is the GPTModel itself).
        guided._open(guided.model, args, kwargs)
        self._open = (guided, records, resolve)
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        if self._open is None:
            return None
        guided, records, resolve = self._open
        self._open = None
        guided._close(module, args, kwargs, output)
        self.micro_batches.append(micro_batch_metrics(guided.trace_metrics(), records, resolve))
        return None

    def _finish(self, args, rollout_id=None) -> None:
        if self.phase is None or not self.micro_batches:
            self.micro_batches = []
            return
        metrics = phase_metrics(self.phase, self.micro_batches)
        self.finished[self.phase] = metrics
        self.micro_batches = []
        _log(args, metrics, rollout_id)


def _log(args, metrics: dict, rollout_id) -> None:
    """Through slime's own logger (wandb / tensorboard), from the main rank, at the rollout's step."""
    if rollout_id is None or not (getattr(args, "use_wandb", False) or getattr(args, "use_tensorboard", False)):
        return
    try:
        from megatron.core import parallel_state as mpu

        main = mpu.get_data_parallel_rank() == 0 and model_parallel_rank0()
    except (AssertionError, RuntimeError):
        main = True
    if main:
        from slime.observability import logging_utils

        logging_utils.log(args, {**metrics, "rollout/step": rollout_id}, step_key="rollout/step")


_GUIDANCE: dict[int, SlimeGuidance] = {}


def guidance_for(args) -> SlimeGuidance:
    """This process's SlimeGuidance for slime's `args` (the command line checked once)."""
    g = _GUIDANCE.get(id(args))
    if g is None:
        trace = check_args(args)
        if trace is None:
            raise TraceSlimeError(
                f"the trace_slime hooks are set but TRACE is off: set {ROLLOUT_HOW} and "
                "--spec trace_slime get_trace_spec, or drop the hooks"
            )
        g = _GUIDANCE[id(args)] = SlimeGuidance(trace)
    return g


def before_log_prob_hook(args, model, store_prefix=""):
    g = guidance_for(args)
    g.install(model)
    g.before_log_prob(args, store_prefix)


def before_train_step_hook(args, rollout_id, step_id, model, optimizer=None, opt_param_scheduler=None):
    g = guidance_for(args)
    g.install(model)
    g.before_train_step(args, rollout_id)
