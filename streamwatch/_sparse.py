"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): one dense vector
with the whole tensor's statistics.

A sparse tensor stores some of its elements; the others are zero. Zeros add nothing to a sum, a sum of
powers or a nonzero count, so a row of the stored values, counted as ``x.numel()`` elements (its
``zeros`` column is then ``count − nonzero``), is the whole tensor's row, once two things are right:

* **duplicates are summed first.** An embedding's backward stores one entry per looked-up token, so a
  token seen twice is stored twice (an uncoalesced COO tensor): the tensor's element is their sum, and
  ``a² + b²`` is not ``(a + b)²``. On the CPU (or when already coalesced) :meth:`torch.Tensor.coalesce`
  sums them. On a device it would wait for the device (the number of distinct entries sizes its
  output), so the entries are sorted by position and each run of one position added into its own slot
  of a buffer the size of the stored entries: no host sync; the unused slots are zeros.
* **min and max see the zeros** that are not stored: one zero is appended when some element is not
  stored (and a device buffer's spare slot is one).

Compressed layouts (CSR, CSC, BSR, BSC) store each element at most once: their values as they are.

Example:
    >>> import torch
    >>> rows, values = [[0, 2, 0]], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    >>> g = torch.sparse_coo_tensor(rows, values, (4, 2), check_invariants=True)
    >>> stored_values(g).tolist()  # row 0 twice: (1, 2) + (5, 6); rows 1 and 3 not stored: a zero
    [6.0, 8.0, 3.0, 4.0, 0.0]
    >>> float(stored_values(g).pow(2).sum()) == float(g.to_dense().pow(2).sum())
    True
"""

from __future__ import annotations

import torch

__all__ = ["stored_values"]


def stored_values(x: torch.Tensor) -> torch.Tensor:
    """A flat dense vector whose sums, sums of powers, nonzero count, min and max are those of the sparse
    tensor ``x`` (counted as ``x.numel()`` elements; see the module docstring). Never waits for a device
    unless the entries of an uncoalesced COO tensor on a device could cover every element (then it
    coalesces, as an optimizer such as ``SparseAdam`` does).

    Example:
        >>> import torch
        >>> g = torch.sparse_coo_tensor([[1, 0, 1]], [1.0, 2.0, 3.0], (2,), check_invariants=True)
        >>> stored_values(g).tolist()  # every element stored: no zero appended
        [2.0, 4.0]
    """
    values = x.detach()
    if x.layout is not torch.sparse_coo:
        flat = values.values().reshape(-1)
    elif x.is_coalesced() or x.device.type == "cpu" or x._nnz() * _dense_size(x) >= x.numel():
        flat = values.coalesce().values().reshape(-1)
    else:
        return _summed_runs(values)
    if flat.numel() < x.numel():
        flat = torch.cat((flat, flat.new_zeros(1)))
    return flat


def _dense_size(x: torch.Tensor) -> int:
    """Elements per stored entry of a COO tensor (its dense dimensions' product)."""
    size = 1
    for n in x.shape[x.sparse_dim() :]:
        size *= n
    return size


def _summed_runs(x: torch.Tensor) -> torch.Tensor:
    """An uncoalesced COO tensor's entries summed by position without a host sync: sorted by their
    linear position, each run of one position added into slot ``run number`` of a zero buffer of
    ``nnz + 1`` entries (the last always spare: a zero, which the caller's count says is there, since
    ``nnz`` entries cannot cover every element here)."""
    indices, values = x._indices(), x._values()
    position = indices[0]
    for dim in range(1, x.sparse_dim()):  # (Python ints: no host-to-device copy)
        position = position * x.shape[dim] + indices[dim]
    position, order = torch.sort(position)
    starts = torch.ones_like(position, dtype=torch.bool)
    starts[1:] = position[1:] != position[:-1]
    run = torch.cumsum(starts, 0) - 1
    summed = values.new_zeros((values.shape[0] + 1, *values.shape[1:]))
    summed.index_add_(0, run, values.index_select(0, order))
    return summed.reshape(-1)
