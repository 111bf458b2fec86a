"""Print, as JSON, what ``torch.compile`` makes of an observed model's summaries on the Triton path:
for each ``triton_kernel_wrapper_functional`` node of the AOT forward graph, its kernel and the tensors
it clones; and the graph breaks. Run by ``tests/test_triton_compile.py`` in a child process without
``TRITON_INTERPRET`` (the kernels as Inductor sees them) and without a GPU: Triton's driver is given an
``sm_90`` target, which is all torch's analysis of what a kernel writes needs (it lowers the kernel to
Triton IR, not to machine code). The forward itself is not run: its compiler hands back a function that
raises, once the graph is captured.
"""

from __future__ import annotations

import json
import os

import torch
import triton
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from triton.backends.compiler import GPUTarget

import streamwatch as sw


class _Driver:
    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class _Captured(Exception):
    pass


def main() -> None:
    # (set here, not at import: pytest's doctest collection imports this file, and its children inherit)
    os.environ["STREAMWATCH_KERNEL"] = "triton"  # (CPU tensors take the kernels' route: traced, never run)
    triton.runtime.driver.set_active(_Driver())
    graphs: list[torch.fx.GraphModule] = []

    def forward_compiler(gm: torch.fx.GraphModule, inputs: object) -> object:
        graphs.append(gm)

        def run(*args: object) -> object:
            raise _Captured

        return run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counters.clear()
    with sw.observe(model, optimizer, every=1, stats=("dead",), taps=("activation",)) as watch:
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=forward_compiler), fullgraph=True)
        try:
            compiled(torch.randn(32, 8))
        except _Captured:
            pass
        watch.step()
    kernels = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
                from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                kernels.append(
                    {
                        "kernel": getattr(getattr(kernel, "fn", None), "__name__", repr(kernel)),
                        "clones": sorted(node.kwargs["tensors_to_clone"]),
                    }
                )
    print(
        json.dumps(
            {"graphs": len(graphs), "graph_breaks": sum(counters["graph_break"].values()), "kernels": kernels}
        )
    )


if __name__ == "__main__":
    main()
