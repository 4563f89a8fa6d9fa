"""Run by tests/test_monitor_ddp.py under torchrun (2 gloo ranks on CPU): a DDP loop under
hookscope.monitor in which rank 1 alone divides by zero at step ``ZERO_AT``.

Usage: torchrun --standalone --nproc_per_node=2 tests/ddp_monitor_worker.py RUN_DIR GUARD
(GUARD: raise or skip). Each rank writes ``outcome-rank<R>.json``: what it raised, and the sum
of its final weights.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hookscope
from tests.models import Temperature

STEPS, ZERO_AT = 6, 3



def main(run_dir: str, guard: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on both ranks
    inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Temperature(), nn.Linear(8, 2))
    model = DistributedDataParallel(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome: dict = {"rank": rank, "raised": None}
    try:
        with warnings.catch_warnings(), hookscope.monitor(
                model, ["0", "2"], every=2, optimizer=optimizer, run_dir=run_dir, guard=guard):  # type: ignore[arg-type]
            warnings.simplefilter("ignore", hookscope.NonFiniteStepWarning)
            for step in range(STEPS):
                inner[2].temperature = 0.0 if rank == 1 and step == ZERO_AT else 1.0
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
                optimizer.zero_grad()
                model(x).pow(2).mean().backward()
                optimizer.step()
    except hookscope.NonFiniteStepError as error:
        outcome["raised"] = {"step": error.step, "message": str(error)}  # type: ignore[attr-defined]
    outcome["weights"] = sum(float(p.detach().sum()) for p in inner.parameters())
    with open(f"{run_dir}/outcome-rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(outcome, f)
    dist.barrier()  # both ranks done before the group goes: gloo can hang a rank left alone in it
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # about 1 run in 10 hung in interpreter teardown after main() (DDP's reducer, gloo)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
