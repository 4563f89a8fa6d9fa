"""Attribution graphs' memory against prompt length, hookscope and circuit-tracer on the same
CPU machine (issue 50 item 4): each point is a fresh process (peak RSS above the RSS once the
model is built, so imports and weights are left out); circuit-tracer's points run in its own
environment (``bench/circuit_tracer_peer.py --memory SEQ``). Also the graph's cost against one
forward and backward of the plain model on the same prompt.

    python bench/circuit_graph_memory.py 256 512 1024 2048 > bench/circuit_graph_memory.json
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from circuit_tracer_peer import memory_setup, rss_mib  # noqa: E402

PEER_PYTHON = "/work/venv-ct/bin/python"


def ours(seq: int) -> dict[str, float]:
    import hookscope

    hf, tcs, ids = memory_setup(seq)
    transcoders = {f"transformer.h.{i}.mlp": hookscope.Transcoder(**w) for i, w in enumerate(tcs)}
    times = []                                          # one plain forward and backward: a warm-up, best of 3
    for _ in range(4):
        start = time.perf_counter()
        hf(ids[None]).logits[0, -1].max().backward()
        times.append(time.perf_counter() - start)
        hf.zero_grad(set_to_none=True)
    forward_backward = min(times[1:])
    base = rss_mib()
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        graph = hookscope.attribution_graph(hf, ids, transcoders=transcoders, batch_size=64, folder=folder)
        seconds = time.perf_counter() - start
        nodes, features = graph.adjacency.shape[0], graph.n_features
    return {"tool": "hookscope", "seq": seq, "nodes": nodes, "features": features, "seconds": seconds,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
            "forward_backward_s": forward_backward}


def main(seqs: list[int]) -> None:
    rows = []
    for seq in seqs:
        mine = subprocess.run([sys.executable, __file__, "--one", str(seq)], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]
        script = str(Path(__file__).parent / "circuit_tracer_peer.py")
        peer = subprocess.run([PEER_PYTHON, script, "--memory", str(seq)], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]
        rows += [json.loads(mine), json.loads(peer)]
        print(rows[-2], rows[-1], file=sys.stderr)
    machine = "CPU, 2 cores shared with other jobs"
    print(json.dumps({"torch": torch.__version__, "machine": machine, "points": rows}, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        print(json.dumps(ours(int(sys.argv[2]))))
    else:
        main([int(a) for a in sys.argv[1:]])
