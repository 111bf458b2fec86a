"""What every hook reads and writes: the tap state, and summarising one tensor into the step.

:class:`TapState` is what the hooks read on every call (which kinds this step samples, the step's buffer,
the fused kernel) and what they count (skipped tensors, errors, their own time); the Watch's step
boundary writes it at each step's end. :func:`summarize_into` turns one tensor into one row of the
step's buffer (the fused CPU kernel where it can read the tensor, else torch ops), skipping odd tensors
and counting them. :func:`guarded` wraps a hook body so that nothing it raises reaches the training step.

Example:
    >>> import torch
    >>> from streamwatch._record import SeriesKey
    >>> state = TapState()
    >>> summarize_into(state, SeriesKey("train", "fc", "activation", ""), torch.ones(2, 3), None)
    >>> summarize_into(state, SeriesKey("train", "fc", "activation", "1"), torch.ones(0), None)
    >>> len(state.buffer), state.skipped
    (1, {'empty': 1})
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch

from streamwatch import _kernel, _triton
from streamwatch._buffer import StepBuffer
from streamwatch._cudagraphs import GraphMemory
from streamwatch._gradprobe import GradProbe
from streamwatch._kernel import FusedKernel
from streamwatch._record import SeriesKey
from streamwatch._sparse import stored_values
from streamwatch._summary import summarize, unit_dim_for
from streamwatch._torchpath import GROUP_ELEMENTS, Packing, Packings, Row, batches, summarize_packed
from streamwatch._triton import Kernels

__all__ = [
    "Hook",
    "StepTimes",
    "TapState",
    "copied",
    "guarded",
    "inert",
    "local",
    "prepare",
    "summarize_into",
    "summarize_many",
]


@dataclass(slots=True)
class StepTimes:
    """Host wall-clock boundaries of the current training step (``perf_counter`` seconds; 0: not seen).

    Set by the root module's forward hooks and the optimizer's step hooks, read at ``watch.step()``,
    which hands them with the step's end to the worker: reading the clock never waits for the device.
    On CUDA the host runs ahead of the device, so a part is when the host got through it — a rank that
    waits (the gradient all-reduce, a data loader) shows it. The worker turns them into the step's
    parts (:func:`~streamwatch._record.step_parts`).

    Example:
        >>> t = StepTimes(step_end=1.0, forward_start=1.5, forward_end=2.0)
        >>> t.optimizer_start, t.optimizer_end = 3.0, 3.25
        >>> from streamwatch._record import step_parts
        >>> marks = (t.step_end, t.forward_start, t.forward_end, t.optimizer_start, t.optimizer_end, 3.5)
        >>> step_parts(marks, {})
        {'part/data_wait': 0.5, 'part/forward': 0.5, 'part/backward': 1.0, 'part/optimizer': 0.25}
    """

    step_end: float = 0.0
    forward_start: float = 0.0
    forward_end: float = 0.0
    optimizer_start: float = 0.0
    optimizer_end: float = 0.0

    clock = staticmethod(perf_counter)
    """The clock every boundary is read from: ``time.perf_counter`` itself (a C call; tests may fake
    it)."""


@dataclass(slots=True)
class TapState:
    """What hooks read on every call; written by the Watch at each step boundary (one thread)."""

    on: Mapping[str, bool] = field(default_factory=dict)  # this step samples this kind
    forward: bool = False  # any forward-side kind is sampled this step
    taps: frozenset[str] = frozenset()
    buffer: StepBuffer = field(default_factory=StepBuffer)
    channel_last: bool | None = None  # the user's override; None: per module, and 4-D/5-D tensors are NCHW
    dead_units: bool = True
    count_nonfinite: bool = False
    kernel: FusedKernel | None = None  # the fused CPU kernel, if it could be built
    triton: Kernels | None = None  # the Triton kernels for CUDA tensors, if they load and compile
    device: str = "cpu"  # the device type the model was last seen on (load_summaries)
    skipped: dict[str, int] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    hook_errors: int = 0
    paused: bool = False  # an opt-in metric runs the model itself (probe batch, Hessian), or the Watch was
    # collected without close() (``_attach.Attachments.drop``, until it is closed): no tap does anything
    # the root module's last call was a training forward (train mode, gradients on): a submodule in eval
    # mode inside it (a frozen BatchNorm) is part of the training step, not an evaluation pass
    root_training: bool = False
    # since the last optimizer step the hooks saw: the root module ran a training forward / a forward in
    # eval mode with gradients on (an optimizer stepping those alone: a model trained in eval mode, warned)
    trained: bool = False
    eval_with_grad: bool = False
    compiled: bool = False  # a hook ran inside torch.compile: hooks stay installed (TapSet.static)
    seen: bool = False  # a forward-side hook or the root module's call ran since the last full boundary
    # reasons compiled code skipped something (``skip``): noted in the graph, moved to ``noted`` outside
    # it (``drain``, so the graph always meets it empty), counted once for the step by ``count_noted``
    skipped_in_graph: dict[str, bool] = field(default_factory=dict)
    noted: set[str] = field(default_factory=set)
    timed: bool = True  # the step samples something: its parts are timed, the optimizer hooks are in
    busy: float = 0.0  # seconds spent inside streamwatch's hooks since the last step boundary
    times: StepTimes = field(default_factory=StepTimes)
    # this step's opt-in metrics: tensor metrics by the kind they read, and parameter-level ones
    kind_metrics: dict[str, list[Callable[[StepBuffer, SeriesKey, torch.Tensor], None]]] = field(
        default_factory=dict
    )
    step_metrics: tuple[Any, ...] = ()
    # how many coming step ends may take the Watch's quiet path; anything that records (an evaluation
    # pass arming its hooks) or fails on the training thread sets it to 0
    quiet: int = 0
    packings: Packings = field(default_factory=Packings)  # summarize_many's, by layout
    # values CUDA graphs overwrote before they were read (dropped, counted in ``skipped``)
    memory: GraphMemory = field(init=False)
    # rows compiled code made (key, count, row, replace), moved into the buffer outside the graph (drain)
    inbox: list[tuple[SeriesKey, int, Row, bool]] = field(default_factory=list)
    # the element counts of outputs compiled code passed through a GradProbe (key, count), empty whenever
    # a pass begins as the inbox is; their rows land in backward with count 0 (``_gradprobe``)
    probed: list[tuple[SeriesKey, int]] = field(default_factory=list)
    probes: list[GradProbe] = field(default_factory=list)  # (their calls set back to 0 by drain)
    counts_due: list[tuple[SeriesKey, int]] = field(default_factory=list)  # probed, out of the graph
    warned_passes: bool = False  # drain warned that several passes came between two drains

    def __post_init__(self) -> None:
        self.memory = GraphMemory(self.skipped)

    def drain(self) -> None:
        """Move the rows compiled code made into the step buffer, outside any graph: after each backward
        pass (a hook on one parameter's accumulated gradient, ``TapSet``), at ``Watch.pass_ends`` (the
        trainer integrations call it after every batch) and at the step's end.

        In a graph, a row only joins :attr:`inbox`, empty whenever a pass begins: dynamo guards on what a
        graph reads of the Python state, and a graph that read the step's rows (their number) would be
        compiled again for every micro-batch of a step, past dynamo's limit of 8 variants, after which
        the model runs uncompiled. Once CUDA graphs overwrote a row (``_cudagraphs``), the rows are
        copied here, while their pass's memory is still theirs.

        Example:
            >>> state = TapState()
            >>> state.drain(); len(state.buffer)
            0
        """
        if self.skipped_in_graph:
            self.noted.update(self.skipped_in_graph)
            self.skipped_in_graph.clear()
        if self.probed:
            self.counts_due.extend(self.probed)
            self.probed.clear()
        if self.compiled:  # (a probe takes one call of its module per pass: GradProbe.calls)
            for probe in self.probes:
                probe.calls = 0
        inbox = self.inbox
        if inbox:
            copy = self.memory.copy  # (CUDA graphs overwrote rows once: copied while still readable)
            for key, count, row, replace in inbox:
                self.buffer.add(key, count, copied(row) if copy else row, replace=replace, traced=True)
            # (passes: the rows of the key seen least often; a module called several times in each pass,
            # as a cell in a loop, has more)
            passes = 0 if self.warned_passes else min(Counter(key for key, _, _, _ in inbox).values())
            inbox.clear()
            if passes >= PASSES_WARNED:
                self.warned_passes = True
                warnings.warn(
                    f"streamwatch: {passes} passes of a compiled model ran between two moments streamwatch "
                    "could take their rows out of the graph (no backward between them: evaluation batches), "
                    "so dynamo compiled a variant of the forward for each, and runs the model uncompiled "
                    "past its limit of 8. Call watch.pass_ends() after each evaluation batch (the Lightning "
                    "and Hugging Face callbacks do) (docs/observe.md#torchcompile)",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def skip(self, reason: str) -> None:
        """Count something not summarised, by ``reason``. In code ``torch.compile`` traces, only noted
        (``TapSet.arm`` counts it once for the step): reading a counter there would make its value a
        guard, and dynamo would compile the forward again at every step."""
        if torch.compiler.is_compiling():
            self.compiled = True
            self.skipped_in_graph[reason] = True
            return
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def settle_counts(self) -> None:
        """Add the element counts of the outputs probed this step (:attr:`probed`) to their rows, once
        every backward of the step is over (their rows landed with count 0, in whatever order autograd
        accumulated them): at the step's end. A count without a row (a forward without a backward) goes.

        Example:
            >>> state = TapState()
            >>> state.probed.append((SeriesKey("train", "fc", "output_grad", ""), 6))
            >>> state.drain(); state.settle_counts(); state.counts_due
            []
        """
        self.drain()
        due = self.counts_due
        if due:
            self.buffer.add_counts(due)
            due.clear()

    def probe_count(self, key: SeriesKey, count: int) -> None:
        """In compiled code: an output of ``count`` elements passed through ``key``'s probe (its gradient's
        row lands without a count: :meth:`settle_counts`)."""
        self.compiled = True
        self.probed.append((key, count))

    def count_noted(self) -> None:
        """Count once what compiled code skipped since the last call (``skip``): at each step boundary.

        Example:
            >>> state = TapState()
            >>> state.skipped_in_graph["compiled_grad_hook"] = True
            >>> state.count_noted(); state.count_noted(); state.skipped
            {'compiled_grad_hook': 1}
        """
        noted = self.noted
        if self.skipped_in_graph:
            noted.update(self.skipped_in_graph)
            self.skipped_in_graph.clear()
        if noted:
            for reason in sorted(noted):
                self.skip(reason)
            noted.clear()

    def traced(self, key: SeriesKey, count: int, row: Row, replace: bool) -> None:
        """A row compiled code made: into :attr:`inbox` (see :meth:`drain`); from the next step boundary on
        every hook stays installed (``TapSet.arm``), whichever module the compiled code called."""
        self.compiled = True
        self.inbox.append((key, count, row, replace))

    def fail(self, exc: BaseException) -> None:
        """Count (and keep the first few of) an exception caught on the training thread."""
        self.hook_errors += 1
        self.quiet = 0  # the next boundary surfaces it
        if len(self.errors) < 16:
            self.errors.append(exc)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``, an exception counted and kept, never raised (one metric cannot stop another)."""
        try:
            fn(*args)
        except Exception as exc:
            self.fail(exc)


def load_summaries(state: TapState, device: str) -> None:
    """Make ``state`` summarise tensors on ``device`` (a device type) in the fastest way that loads: the
    fused kernel for the CPU (unless ``STREAMWATCH_KERNEL=triton``), the Triton kernels for any other
    device; each loads once, and the other's stays (a model split over devices). ``observe()`` calls it
    for where the model is; a sampled step again where the model has moved since (``observe()`` before
    ``model.to("cuda")``, ``accelerator.prepare()`` or ``fabric.setup()``), whose tensors would otherwise
    take the torch path, with several launches each where a kernel takes one.

    Example:
        >>> state = TapState()
        >>> load_summaries(state, "cpu")
        >>> state.device, kernel_status(state).split(":")[0] in ("fused", "torch")
        ('cpu', True)
    """
    state.device = device
    if device == "cpu" and not _triton.forced():
        if state.kernel is None:
            state.kernel = _kernel.load()
    elif state.triton is None:
        state.triton = _triton.load()


def kernel_status(state: TapState) -> str:
    """How tensors on the model's device are summarised (``statistics().kernel``): the fused kernel's
    status for a CPU model, the Triton kernels' for any other."""
    return _kernel.status() if state.device == "cpu" and not _triton.forced() else _triton.status()


def local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2's sharded parameters, gradients and updates; tensor
    parallel): a view, no collective. Its sums of squares and counts add up across ranks to the whole
    tensor's (docs/scale.md). Any other tensor as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded by whatever made a DTensor
    if dtensor is not None and isinstance(x, dtensor.DTensor):
        return x.to_local()  # type: ignore[no-any-return]
    return x


def prepare(x: torch.Tensor, state: TapState, detach: bool = True) -> torch.Tensor | None:
    """A dense real floating view of ``x`` to summarise, or None (skipped and counted); detached if it
    requires a gradient, unless ``detach`` is False (the caller reads it under ``torch.no_grad()``)."""
    x = local(x)
    if x.is_nested:  # (strided or jagged: no single shape to take units or a flat pass from)
        state.skip("nested")
        return None
    if x.is_sparse or x.layout != torch.strided:
        state.skip("sparse")
        return None
    if x.is_complex():
        state.skip("complex")
        return None
    if x.is_quantized or x.device.type == "meta":
        state.skip("unsupported_tensor")
        return None
    if x.numel() == 0:
        state.skip("empty")
        return None
    if detach and x.requires_grad:  # (a gradient needs no detach: one dispatched op less per tensor)
        x = x.detach()
    if not x.is_floating_point():
        x = x.to(torch.float32)  # bool masks, integer ids: summarised as numbers
    return x


PASSES_WARNED = 4
"""Compiled passes between two drains from which :meth:`TapState.drain` warns (each is a variant of the
forward dynamo compiled; its limit is 8)."""


def copied(row: Row) -> Row:
    """``row`` with its tensors copied (a tensor it holds in several fields, copied once).

    Example:
        >>> x = torch.ones(2)
        >>> row = Row(x, x, x)
        >>> c = copied(row); c.gram is c.low and c.gram is not x and torch.equal(c.gram, x)
        True
    """
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        found = copies.get(id(t))
        if found is None:
            found = copies[id(t)] = t.clone()
        return found

    return dataclasses.replace(
        row,
        gram=copy(row.gram),
        low=copy(row.low),
        high=copy(row.high),
        nonfinite=None if row.nonfinite is None else copy(row.nonfinite),
        unit_counts=None if row.unit_counts is None else copy(row.unit_counts),
    )


def summarize_into(
    state: TapState,
    key: SeriesKey,
    x: torch.Tensor,
    channel_last: bool | None,
    replace: bool = False,
    bounds: tuple[float, float] | None = None,
) -> None:
    """Summarise ``x`` into the current step buffer under ``key`` (skips odd tensors, counted).

    ``channel_last`` says where units are for per-unit activity (None: none taken); ``bounds`` are the
    producing module's saturation bounds (activations only). A sparse gradient takes its own path
    (:func:`_summarize_sparse`).
    """
    x = local(x)
    if x.layout is not torch.strided and not x.is_nested:
        _summarize_sparse(state, key, x, channel_last, replace)
        return
    prepared = prepare(x, state)
    if prepared is None:
        return
    unit_dim = None
    if channel_last is not None and state.dead_units:
        if state.channel_last is None and prepared.dim() >= 4:
            channel_last = False  # NCHW / NCDHW: a ReLU after a Conv2d has channels in dim 1 too
        unit_dim = unit_dim_for(prepared, channel_last)
    kernel, triton = state.kernel, state.triton
    readable = kernel.readable(prepared) if kernel is not None else None
    if (
        triton is not None
        and triton.accepts(prepared)
        and triton.op is not None
        and torch.compiler.is_compiling()
    ):
        row = triton.traced_row(prepared, unit_dim=unit_dim, bounds=bounds)  # (the registered op: no break)
        state.traced(key, prepared.numel(), row, replace)
    elif triton is not None and triton.accepts(prepared) and not torch.compiler.is_compiling():
        try:
            row = state.buffer.triton_arena(triton, prepared.device).summarize(
                prepared, unit_dim=unit_dim, bounds=bounds
            )
        except Exception as exc:  # (a kernel that would not compile: the torch path from now on)
            triton.give_up(exc)
            row = summarize(prepared, unit_dim=unit_dim, count_nonfinite=state.count_nonfinite, bounds=bounds)
        state.buffer.add(key, prepared.numel(), row, replace=replace)
    elif readable is not None and not torch.compiler.is_compiling():
        assert kernel is not None
        prepared = readable  # (a strided view: copied once, contiguous)
        state.buffer.add_host(kernel, key, prepared, unit_dim=unit_dim, bounds=bounds, replace=replace)
    else:
        row = summarize(prepared, unit_dim=unit_dim, count_nonfinite=state.count_nonfinite, bounds=bounds)
        if torch.compiler.is_compiling():  # (the step's rows are not read in a graph: see TapState.drain)
            state.traced(key, prepared.numel(), row, replace)
        else:
            state.buffer.add(key, prepared.numel(), row, replace=replace)
    if state.kind_metrics:  # opt-in tensor metrics (histograms, p-norms) on this step's tensors
        for metric in state.kind_metrics.get(key.kind, ()):
            state.call(metric, state.buffer, key, prepared)


def _summarize_sparse(
    state: TapState, key: SeriesKey, x: torch.Tensor, channel_last: bool | None, replace: bool
) -> None:
    """A sparse gradient's row (``nn.Embedding(sparse=True)``): its stored values, duplicates summed, on
    the torch path, counted as the whole tensor (:mod:`streamwatch._sparse`). Skipped and counted
    (``sparse``) where that cannot be exact: per-unit activity (activations), complex or integer
    values, compiled code. Opt-in tensor metrics (histograms, p-norms) skip it, counted
    (``sparse_metric``): they would not see the zeros that are not stored."""
    if (
        channel_last is not None
        or not x.is_floating_point()
        or x.device.type == "meta"
        or torch.compiler.is_compiling()
    ):
        state.skip("sparse")
        return
    if x.numel() == 0:
        state.skip("empty")
        return
    row = summarize(stored_values(x), unit_dim=None, count_nonfinite=state.count_nonfinite)
    state.buffer.add(key, x.numel(), row, replace=replace)
    if state.kind_metrics.get(key.kind):
        state.skip("sparse_metric")


def summarize_many(state: TapState, items: Sequence[tuple[SeriesKey, torch.Tensor]]) -> None:  # one kind
    """Summarise several tensors of the parameter kinds into the step (each replacing an earlier row of
    its key): with the fused kernel and CPU tensors (the first one's device decides) one by one as
    :func:`summarize_into` does; otherwise (CUDA; ``STREAMWATCH_KERNEL=torch``) in packs of a device,
    copied in by one multi-tensor op and summarised by a fixed number of ops each
    (``_torchpath.summarize_packed``). Exact non-finite counts, opt-in tensor metrics and compiled code
    take the one-by-one path. One failing tensor (or pack) stops only itself."""
    if not items:
        return
    kind = items[0][0].kind
    if (
        (state.kernel is not None and items[0][1].device.type == "cpu")
        or (state.count_nonfinite and not (state.triton is not None and state.triton.accepts(items[0][1])))
        or state.kind_metrics.get(kind)
        or torch.compiler.is_compiling()
    ):
        for key, x in items:
            state.call(summarize_into, state, key, x, None, True)
        return
    packed: dict[torch.device, list[tuple[SeriesKey, torch.Tensor]]] = {}
    for key, x in items:
        if x.layout is not torch.strided:  # (a sparse gradient: its own path, see summarize_into)
            state.call(summarize_into, state, key, x, None, True)
            continue
        prepared = prepare(x, state, detach=False)  # (read under no_grad)
        if prepared is not None and prepared.numel() > GROUP_ELEMENTS:  # alone: a pack would copy it
            state.call(summarize_into, state, key, prepared, None, True)
        elif prepared is not None:
            packed.setdefault(prepared.device, []).append((key, prepared))
    for members in packed.values():
        for run in batches([x.numel() for _, x in members]):
            state.call(_summarize_pack, state, [members[i] for i in run])


def _summarize_pack(state: TapState, members: list[tuple[SeriesKey, torch.Tensor]]) -> None:
    tensors = [x for _, x in members]
    pack, flipped = state.packings.get(tensors)
    with torch.no_grad():
        pack.fill(tensors[::-1] if flipped else tensors)
        rows = summarize_pack(state, pack, reverse=flipped)
    for (key, x), row in zip(members, rows, strict=True):
        state.buffer.add(key, x.numel(), row, replace=True)


def summarize_pack(state: TapState, pack: Packing, reverse: bool = False) -> list[Row]:
    """The rows of a filled pack: one Triton launch where the kernels take it (CUDA), else the torch
    path's fixed number of ops (``_torchpath.summarize_packed``)."""
    triton = state.triton
    if triton is not None and triton.accepts(pack.buffer):
        try:
            return state.buffer.triton_arena(triton, pack.device).summarize_packed(pack, reverse=reverse)
        except Exception as exc:  # (as in summarize_into)
            triton.give_up(exc)
    return summarize_packed(pack, reverse=reverse)


def inert(*args: Any, **kwargs: Any) -> None:
    """What a copy of an observed model holds in place of a streamwatch hook: nothing happens."""


def _make_inert() -> Callable[..., None]:
    return inert


class Hook:
    """A hook streamwatch installs. ``copy.deepcopy`` of the model (an EMA or a teacher copy) and
    pickling it whole (``torch.save(model)``) copy a module's hooks: they get :func:`inert` instead, so
    the copy carries nothing of the Watch (its calls are not summarised into it, and a hook that holds
    the kernel's C pointers does not make the copy fail).

    Example:
        >>> import copy, pickle
        >>> hook = Hook(print)
        >>> copy.deepcopy(hook) is inert, pickle.loads(pickle.dumps(hook)) is inert
        (True, True)
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return inert

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _make_inert, ()


def guarded(state: TapState, fn: Callable[..., Any], eager: bool = False) -> Callable[..., Any]:
    """Run a hook body so that nothing it raises reaches the training step (counted, kept). The hook
    returns what the body returns (a forward hook's replacement output; None if the body raised). With
    ``eager``, code ``torch.compile`` traces calls it as it is (a graph break) instead of tracing it."""

    def hook(*args: Any) -> Any:
        if state.paused:  # (a metric runs the model itself; or the Watch was dropped unclosed)
            return None
        compiling = torch.compiler.is_compiling()  # a constant to dynamo: no wall clock inside a graph
        start = 0.0 if compiling else perf_counter()
        result = None
        try:
            result = fn(*args)
        except Exception as exc:
            state.fail(exc)
        if not compiling:
            state.busy += perf_counter() - start  # streamwatch's own time on the training thread
        return result

    return Hook(torch.compiler.disable(hook) if eager else hook)
