"""The scheduler: gives every graph node a backend, cuts the graph into splits, binds calls.

Assignment rule (recorded per node in `node.cause`, shown by --explain):
  wgt  the node multiplies by a weight: it runs where that weight lives
  inp  no weight: it follows the backend of its first input produced by an earlier node
  def  nothing to follow (graph inputs only): the default backend
A split is a maximal run of consecutive nodes on one backend. With only the CPU backend
the whole graph is one split; the hybrid CPU+GPU issue adds copies between splits here.
"""
import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Split:
    backend: str
    nodes: list


class Plan:
    """A bound graph: `run()` executes it; `run_timed(acc)` adds seconds per op type to acc."""

    def __init__(self, graph, splits, steps, buffers):
        self.graph, self.splits, self.steps, self.buffers = graph, splits, steps, buffers

    def run(self):
        for step in self.steps:
            step()

    def run_timed(self, acc):
        clock = time.perf_counter
        for node, step in zip(self.graph.nodes, self.steps):
            t0 = clock()
            step()
            acc[(node.backend, node.op)] += clock() - t0


def assign_backends(graph, weight_backend, default="CPU"):
    """Set node.backend and node.cause for every node (see the module docstring)."""
    producer = {}
    for node in graph.nodes:
        if node.weight is not None:
            node.backend, node.cause = weight_backend(node.weight), "wgt"
        else:
            src = next((producer[s] for s in node.srcs if s in producer), None)
            node.backend, node.cause = (src, "inp") if src else (default, "def")
        for out in node.outs:
            producer[out] = node.backend


def make_splits(graph):
    splits = []
    for node in graph.nodes:
        if not splits or splits[-1].backend != node.backend:
            splits.append(Split(node.backend, []))
        splits[-1].nodes.append(node)
    return splits


def make_plan(graph, backends, weights, state, weight_backend=lambda name: "CPU"):
    assign_backends(graph, weight_backend)
    splits = make_splits(graph)
    if any(s.backend not in backends for s in splits):
        missing = sorted({s.backend for s in splits} - set(backends))
        raise ValueError(f"no backend for {missing}")
    cpu = backends["CPU"]
    buffers = {name: cpu.alloc(b) for name, b in graph.buffers.items()}
    steps = [backends[n.backend].bind(n, buffers, weights, state) for n in graph.nodes]
    return Plan(graph, splits, steps, buffers)


def new_timing_table():
    return defaultdict(float)
