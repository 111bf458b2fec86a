"""Which modules to observe: :class:`Select` and the ``select=`` shorthands, checked before anything is
attached (TorchScript modules run without Python hooks and are refused up front), and the parameters
their taps read.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> [name for name, _ in resolve_select(nn.Linear).modules(model)]
    ['0', '2']
    >>> [(layer, name) for layer, name, _ in named_params(model, resolve_select("2").modules(model), False)]
    [('2', 'weight'), ('2', 'bias')]
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = [
    "PARALLEL",
    "WRAPPERS",
    "Select",
    "check_hookable",
    "describe_modules",
    "is_adapter",
    "named_layers",
    "named_params",
    "resolve_select",
]

WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_forward_module")
"""The attributes module wrappers keep the wrapped module under: ``torch.compile``'s ``OptimizedModule``,
``checkpoint_wrapper``, FSDP1 and Lightning Fabric's ``_FabricModule`` (what ``fabric.setup`` returns; it
holds the module a second time as ``_original_module``, listed once). Left out of layer names, as
``torch.distributed.checkpoint`` leaves them out of its parameter names: a block compiled on its own
(``model.layers[i] = torch.compile(block)``) is ``layers.0.attn``, as uncompiled, and a model set up by
Fabric has the names it has without Fabric."""

PARALLEL = (nn.DataParallel, nn.parallel.DistributedDataParallel)
"""Wrappers that keep the model under ``module``: that name is left out only for these classes (a model's
own submodule may well be called ``module``)."""


def _deepspeed_engine(module: nn.Module) -> bool:
    """Whether ``module`` is DeepSpeed's ``DeepSpeedEngine`` (what ``deepspeed.initialize`` returns), which
    keeps the model under ``module`` as DDP does (recognised without importing ``deepspeed``)."""
    kind = type(module)
    return kind.__name__ == "DeepSpeedEngine" and kind.__module__.startswith("deepspeed.")


def named_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` without torch's wrappers: their attributes left out of the names
    (:data:`WRAPPERS`, and ``module`` of DDP, ``DataParallel`` (:data:`PARALLEL`) and DeepSpeed's
    engine), the wrappers
    themselves not listed (the module a wrapper holds goes by its name).

    Example:
        >>> inner = nn.Sequential(nn.Linear(2, 2))
        >>> outer = nn.Sequential(inner)
        >>> outer[0] = torch.compile(inner, backend="eager")
        >>> [name for name, _ in named_layers(outer)]
        ['', '0', '0.0']
        >>> [name for name, _ in named_layers(nn.DataParallel(inner))]
        ['', '0']
    """
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()  # (a module reached twice is listed once, as named_modules() does)

    def walk(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        children = module._modules
        parallel = isinstance(module, PARALLEL) or _deepspeed_engine(module)
        if not (any(attr in children for attr in WRAPPERS) or (parallel and "module" in children)):
            found.append((name, module))
        for attr, child in children.items():
            if child is not None:
                through = attr in WRAPPERS or (parallel and attr == "module")
                walk(child, name if through else f"{name}.{attr}" if name else attr)

    walk(model, "")
    return found


@dataclass(frozen=True, slots=True)
class Select:
    """Which modules to tap; every criterion given must hold (AND), none given means all leaf modules.

    Attributes:
        types: module classes (``isinstance``).
        names: ``fnmatch`` globs on the qualified name (``"encoder.*.fc"``).
        depth: only modules at this depth (``0`` is the model itself, ``1`` its children, ...).
        indices: positions in ``model.named_modules()`` order (torchfunc's ``indices``; torch's wrappers
            left out: :func:`named_layers`).
        leaves: only modules without children, and adapters of a layer (PEFT's LoRA layers:
            :func:`is_adapter`), the default when no other criterion is given.

    A single class, glob or index is read as a one-element tuple (``Select(names="fc")`` is
    ``Select(names=("fc",))``); anything else that is not a criterion is refused with a ``TypeError``.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [name for name, _ in Select(types=(nn.Linear,)).modules(model)]
        ['0', '2']
        >>> [name for name, _ in Select(names=("1",)).modules(model)]
        ['1']
    """

    types: tuple[type[nn.Module], ...] = ()
    names: tuple[str, ...] = ()
    depth: int | None = None
    indices: tuple[int, ...] = ()
    leaves: bool | None = None

    def __post_init__(self) -> None:
        types = _as_tuple(self.types, "types", lambda t: isinstance(t, type) and issubclass(t, nn.Module))
        names = _as_tuple(self.names, "names", lambda n: isinstance(n, str))
        indices = _as_tuple(self.indices, "indices", _is_index)
        if self.depth is not None and not _is_index(self.depth):
            raise TypeError(f"Expected `Select.depth` to be an integer >= 0 or None, got {self.depth!r}")
        if self.leaves is not None and not isinstance(self.leaves, bool):
            raise TypeError(f"Expected `Select.leaves` to be True, False or None, got {self.leaves!r}")
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "indices", indices)

    def modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The selected ``(name, module)`` pairs, in ``named_modules()`` order; names without the
        attributes of torch's wrappers (:func:`named_layers`), the wrappers themselves left out."""
        leaves = self.leaves
        if leaves is None:
            leaves = not (self.types or self.names or self.depth is not None or self.indices)
        picked = []
        for index, (name, module) in enumerate(named_layers(model)):
            if leaves and next(module.children(), None) is not None and not is_adapter(module):
                continue
            if self.types and not isinstance(module, self.types):
                continue
            if self.names and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names):
                continue
            if self.depth is not None and (name.count(".") + 1 if name else 0) != self.depth:
                continue
            if self.indices and index not in self.indices:
                continue
            picked.append((name, module))
        return picked


def is_adapter(module: nn.Module) -> bool:
    """Whether ``module`` adapts a layer it holds as ``base_layer`` (PEFT's tuner layers: a LoRA ``Linear``
    adds its low-rank path to its base layer's output). Its output is what the model sees of the layer, so
    the default selection takes it beside the leaves inside it.

    Example:
        >>> class Adapted(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.base_layer, self.up = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> is_adapter(Adapted()), is_adapter(nn.Sequential(nn.Linear(2, 2)))
        (True, False)
        >>> [name for name, _ in Select().modules(nn.Sequential(Adapted()))]
        ['0', '0.base_layer', '0.up']
    """
    return "base_layer" in module._modules


_CRITERIA = {
    "types": "module classes",
    "names": "name globs (str)",
    "indices": "integers >= 0 (positions in model.named_modules(), torch's wrappers left out)",
}


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _as_tuple(value: object, field_name: str, ok: Callable[[object], bool]) -> tuple[Any, ...]:
    """One criterion of :class:`Select` as a tuple: a single item is a one-element tuple."""
    items = tuple(value) if isinstance(value, tuple | list) else (value,)
    bad = [item for item in items if not ok(item)]
    if bad:
        raise TypeError(
            f"Expected `Select.{field_name}` to be a tuple of {_CRITERIA[field_name]}, got {value!r}"
        )
    return items


def describe_modules(model: nn.Module, limit: int = 8) -> str:
    """A few of ``model``'s qualified module names, for error messages."""
    names = [name for name, _ in named_layers(model)]
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_hookable(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
    """Refuse TorchScript modules before any hook is installed: they run without Python hooks, so
    streamwatch would observe nothing (and torch refuses the registration half-way). Refuse a lazy
    module's parameters not made yet (``nn.LazyLinear`` before its first forward): torch refuses their
    hooks and shapes, as ``DistributedDataParallel`` and ``torch.compile`` do."""
    lazy = [name for name, param in model.named_parameters() if is_lazy(param)]
    if lazy:
        raise ValueError(
            f"`model` has parameters a lazy module has not made yet ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): run one forward pass on a batch of the real shape before "
            "observe() (and before making the optimizer), as torch asks for LazyModules"
        )
    script = torch.jit.ScriptModule
    if isinstance(model, script):
        raise TypeError(
            f"Expected `model` to be an eager torch.nn.Module, got a TorchScript module "
            f"({type(model).__name__}, from torch.jit.script or torch.jit.trace): TorchScript runs without "
            "Python hooks, so nothing could be observed. Observe the eager model (torch.compile works)."
        )
    scripted = [name for name, module in model.named_modules() if isinstance(module, script)]
    for name, module in modules:
        if isinstance(module, script):
            outer = next(s for s in scripted if name == s or name.startswith(f"{s}."))  # pre-order: outermost
            raise TypeError(
                f"Layer {outer!r} of `model` is a TorchScript module ({type(module).__name__}): TorchScript "
                "runs without Python hooks, so it cannot be observed. Keep it eager, or leave it out with "
                "`select=` (e.g. streamwatch.Select(names=...))."
            )


def resolve_select(select: object) -> Select:
    """Turn the ``select=`` shorthands into a :class:`Select`.

    Accepts ``None`` (leaf modules), a :class:`Select`, a glob ``str``, a module class, a tuple of
    classes, or a sequence of globs.
    """
    if select is None:
        return Select()
    if isinstance(select, Select):
        return select
    if isinstance(select, str):
        return Select(names=(select,))
    if isinstance(select, type) and issubclass(select, nn.Module):
        return Select(types=(select,))
    if (
        isinstance(select, tuple)
        and select
        and all(isinstance(t, type) and issubclass(t, nn.Module) for t in select)
    ):
        return Select(types=select)
    if isinstance(select, Sequence) and select and all(isinstance(s, str) for s in select):
        return Select(names=tuple(select))
    raise TypeError(
        "Expected `select` to be None, a streamwatch.Select, a name glob, a module class or a tuple of "
        f"classes, got {select!r}"
    )


def named_params(
    model: nn.Module, modules: list[tuple[str, nn.Module]], all_params: bool
) -> list[tuple[str, str, nn.Parameter]]:
    """``(layer, name, parameter)`` triples: every parameter of the model (by owner) or the selected ones."""
    seen: set[int] = set()
    triples = []
    for layer, module in named_layers(model) if all_params else modules:
        for pname, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                triples.append((layer, pname, param))
    return triples
