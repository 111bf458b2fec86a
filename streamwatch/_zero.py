"""DeepSpeed ZeRO: each parameter's fragment in this rank's optimizer partition.

Under ZeRO (stages 1–3, and DeepSpeed's BF16 optimizer) the model's parameters are not what the
optimizer steps. DeepSpeed keeps the float32 master weights of this rank's share of every parameter in a
few flat tensors (one per parameter group; per sub-group under stage 3), hands each one its float32
gradient partition (averaged over the ranks, unscaled, clipped) just before the torch optimizer it wraps
steps it, and copies the result back into the model. So a parameter's rows come from its *fragment*:
its elements in this rank's flat partition, a view (:class:`Fragments`):

* ``param`` and ``update``: the fragment of the master weights, read around the inner optimizer's step
  as for any parameter (the update is the change the step made to it, in float32);
* ``param_grad``: the same elements of the flat gradient, the gradient the step applies. The fragment
  views get it as their ``.grad`` while the inner optimizer steps (:meth:`Fragments.refresh`), and lose
  it after (:meth:`Fragments.release`: a held gradient partition would keep its memory alive).

Each rank reads its own fragments, with no collective call: a parameter's sums of squares and element
counts add up over the ranks to the whole parameter's, as for FSDP2's shards (docs/scale.md#deepspeed-zero).
A parameter none of whose elements are this rank's has an empty fragment (skipped and counted,
``empty``); one the ZeRO optimizer does not hold (frozen) is read as the model holds it.

Only DeepSpeed's own attributes are read (``_hp_mapping``, ``grad_position``); ``deepspeed`` is never
imported here: a ZeRO optimizer is recognised by what it has (:func:`find`).

Example:
    >>> import torch
    >>> find(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) is None
    True
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

__all__ = ["Fragments", "find", "fragments"]

FLATS = ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_partitioned_groups_flat")
"""Where a DeepSpeed optimizer keeps its flat float32 partitions: ZeRO stages 1 and 2
(``DeepSpeedZeroOptimizer``), the BF16 optimizer, ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``)."""


def find(optimizer: object) -> Any | None:
    """The DeepSpeed ZeRO (or BF16) optimizer ``optimizer`` is or wraps (Accelerate's
    ``DeepSpeedOptimizerWrapper`` keeps it in ``.optimizer``, Lightning's ``LightningOptimizer`` in
    ``._optimizer``), or the first of a list of optimizers (Lightning's ``trainer.optimizers``); else None.

    Example:
        >>> class Wrapper:  # Accelerate's, around DeepSpeed's
        ...     def __init__(self, optimizer): self.optimizer = optimizer
        >>> class Zero:  # what DeepSpeed's ZeRO optimizer has
        ...     __module__ = "deepspeed.runtime.zero.stage_1_and_2"
        ...     def __init__(self):
        ...         self.single_partition_of_fp32_groups = []
        ...         self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> zero = Zero()
        >>> find(Wrapper(zero)) is zero, find([Wrapper(zero)]) is zero, find(zero.optimizer)
        (True, True, None)
    """
    if isinstance(optimizer, list | tuple):
        return next((found for found in map(find, optimizer) if found is not None), None)
    for _ in range(8):  # wrappers of wrappers, bounded
        if optimizer is None:
            return None
        if (
            type(optimizer).__module__.startswith("deepspeed.")
            and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
            and any(hasattr(optimizer, name) for name in FLATS)
        ):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        optimizer = inner if inner is not None else getattr(optimizer, "_optimizer", None)
    return None


@dataclass
class Fragments:
    """The fragment views of the parameters a ZeRO optimizer holds, and the flat partitions they are in.

    Attributes:
        spots: per fragment view: the view (float32 master weights), its flat partition, its offset there
            and its element count.
        home: ``id(view)`` → its flat partition (the tensor the inner optimizer's param groups hold).

    Example:
        >>> flat = torch.nn.Parameter(torch.arange(6.0))
        >>> frags = Fragments()
        >>> view = frags.add(flat, 2, 3)
        >>> flat.grad = torch.ones(6)
        >>> frags.refresh(); view.tolist(), view.grad.tolist(), frags.home[id(view)] is flat
        ([2.0, 3.0, 4.0], [1.0, 1.0, 1.0], True)
        >>> frags.release(); view.grad is None
        True
    """

    spots: list[tuple[torch.Tensor, torch.Tensor, int, int]] = field(default_factory=list)
    home: dict[int, torch.Tensor] = field(default_factory=dict)
    given: bool = False  # (the views hold gradients now)

    def add(self, flat: torch.Tensor, start: int, numel: int) -> torch.Tensor:
        """A view of ``numel`` elements of ``flat`` from ``start`` (a leaf: it can be given a ``.grad``)."""
        view = flat.detach().narrow(0, start, numel)
        self.spots.append((view, flat, start, numel))
        self.home[id(view)] = flat
        return view

    def refresh(self) -> None:
        """Give each view its elements of its flat partition's gradient, where the partition has one (the
        ones the inner optimizer is about to step)."""
        for view, flat, start, numel in self.spots:
            grad = flat.grad
            view.grad = None if grad is None else grad.detach().narrow(0, start, numel)
        self.given = True

    def release(self) -> None:
        """Drop every view's gradient (after the inner optimizer's step)."""
        if self.given:
            for view, _, _, _ in self.spots:
                view.grad = None
            self.given = False


def fragments(
    optimizer: object, params: list[tuple[str, str, nn.Parameter]]
) -> tuple[list[tuple[str, str, nn.Parameter]], Fragments] | None:
    """``params`` with each parameter a ZeRO optimizer in ``optimizer`` holds replaced by its fragment
    view, and the :class:`Fragments`; None without such an optimizer, or (warned) with one whose
    partitions this version cannot read: the parameters are then read as the model holds them."""
    zero = find(optimizer)
    if zero is None:
        return None
    frags = Fragments()
    try:
        spot = _stage3(zero) if hasattr(zero, "fp32_partitioned_groups_flat") else _linked(zero)
        replaced = []
        for layer, pname, param in params:
            found = spot(param)
            # (a view stands where the taps expect a parameter: they read its data and .grad only)
            replaced.append((layer, pname, param if found is None else cast(nn.Parameter, frags.add(*found))))
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        warnings.warn(
            f"streamwatch: cannot find the parameters' fragments in DeepSpeed's {type(zero).__name__} "
            f"({type(exc).__name__}: {exc}); weights, gradients and updates are read as the model holds "
            "them, which under ZeRO is not what the optimizer steps (docs/scale.md#deepspeed-zero)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return replaced, frags


def _linked(zero: Any) -> Any:
    """Stages 1 and 2, and the BF16 optimizer: DeepSpeed links each parameter with a fragment on this
    rank to it (``param._hp_mapping``: its offset in the flat partition of its group)."""
    flats = getattr(zero, "single_partition_of_fp32_groups", None)
    if flats is None:
        flats = zero.fp32_groups_flat_partition
    groups = zero.bit16_groups if hasattr(zero, "bit16_groups") else zero.bf16_groups
    held = {id(param) for group in groups for param in group}

    def spot(param: nn.Parameter) -> tuple[torch.Tensor, int, int] | None:
        if id(param) not in held:
            return None
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # (held, none of its elements this rank's)
            return flats[0], 0, 0
        address = mapping.hp_fragment_address
        return flats[mapping.param_group_index], int(address.start), int(address.numel)

    return spot


def _stage3(zero: Any) -> Any:
    """Stage 3: every parameter is partitioned over the ranks (``partition_numel()`` elements each, the
    last rank's padded); ``grad_position`` has its sub-group and offset in the flat partitions."""
    flats = zero.fp32_partitioned_groups_flat
    positions = zero.grad_position
    try:
        rank = torch.distributed.get_rank(group=zero.dp_process_group)
    except (RuntimeError, ValueError, AttributeError):  # (no process group: one rank)
        rank = 0

    def spot(param: nn.Parameter) -> tuple[torch.Tensor, int, int] | None:
        position = positions.get(zero.get_param_id(param)) if hasattr(param, "ds_id") else None
        if position is None:
            return None
        group, start, numel = (int(v) for v in position)
        whole = int(param.ds_numel)  # type: ignore[attr-defined]
        valid = max(0, min(numel, whole - rank * numel))  # (the last rank's padding left out)
        return flats[group], start, valid

    return spot
