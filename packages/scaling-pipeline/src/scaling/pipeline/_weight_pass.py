"""The zero-bubble split of a backward into an input pass and a weight pass, without doing the work twice.

The input pass differentiates a chunk's outputs with respect to its inputs only. The weight pass
must then reach the parameters; started again from the outputs, autograd would recompute every
gradient on the way (the whole input chain: a second backward). Instead, before the input pass,
each parameter's path is followed toward the outputs until it meets the input chain: the nodes met
there (the "junctions", e.g. a linear's matrix product, whose gradient feeds both its input and its
weight) get a pre-hook that keeps the gradient of their outputs as the input pass computes it. The
weight pass starts from those junctions with the kept gradients and runs only the parameters'
branches (``torch.autograd.backward`` on the junctions' gradient edges with ``inputs=params``, so the
gradients accumulate into ``.grad`` and the post-accumulate hooks run as in a whole backward).

A junction that lies below another on the weight side would get the other's contribution twice (once
kept, once flowing down again), so during the weight pass each junction's incoming gradient is
replaced by the one it kept. Where the chunk's input needs no gradient (the first stage's token ids),
or a parameter's gradient reaches the outputs without meeting the inputs' chain, the weight pass is
a whole backward from the outputs (the input pass computed nothing to reuse). torch's pipelining splits its backward the same way
(``stage_backward_input`` / ``stage_backward_weight``).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For each node under ``roots``, the nodes whose gradient flows into it (toward the outputs)."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    todo = deque(roots)
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return consumers


def _toward_outputs(
    starts: Sequence[Node], consumers: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``starts`` toward the outputs, not going past ``stop``'s; and the ``stop``
    nodes met."""
    reached, met = set(starts), set()
    todo = deque(starts)
    while todo:
        for node in consumers.get(todo.popleft(), ()):
            if node in reached:
                continue
            if node in stop:
                met.add(node)
                continue
            reached.add(node)
            todo.append(node)
    return reached, met


@dataclass(eq=False)  # told apart by identity: their tensors do not compare to a bool
class _Group:
    """Parameters whose gradients leave the input chain at the same junctions."""

    params: list[torch.Tensor]
    junctions: set[Node]


class WeightPass:
    """What the weight pass of one micro-batch's chunk needs: each parameter group's junctions, and
    the gradients the input pass leaves there.

    Build it before the input pass (its hooks keep the gradients), run the input pass, call
    :meth:`stop_capturing`, and later :meth:`run`.
    """

    def __init__(self, roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
        self.params = [p for p in params if p.requires_grad]
        consumers = _consumers([t.grad_fn for t in roots if t.grad_fn is not None])
        # A leaf's gradient accumulator, found by the tensor it holds: asking the leaf for it makes a
        # view, which a ZeRO-3 parameter holding no values between its layer's uses refuses.
        accumulators = {id(node.variable): node for node in consumers if hasattr(node, "variable")}

        def node_of(t: torch.Tensor) -> Node | None:
            return t.grad_fn if t.grad_fn is not None else accumulators.get(id(t))

        input_nodes = [n for n in map(node_of, inputs) if n is not None]
        input_chain, _ = _toward_outputs(input_nodes, consumers, set())
        self.replay = not input_nodes  # no input to split off: the weight pass is the whole backward
        self.groups: list[_Group] = []
        for param in self.params:
            node = node_of(param)
            if node is None:
                continue  # not used by this micro-batch (an expert no token chose)
            _, met = _toward_outputs([node], consumers, input_chain)
            if not met:  # its gradient reaches the outputs without the inputs' chain
                self.replay = True
            group = _Group([param], met)
            for other in [g for g in self.groups if g.junctions & met]:
                self.groups.remove(other)
                group = _Group(other.params + group.params, other.junctions | group.junctions)
            self.groups.append(group)
        junctions = set() if self.replay else {n for g in self.groups for n in g.junctions}
        self.kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self._handles = [node.register_prehook(self._keeper(node)) for node in junctions]

    def _keeper(self, node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            self.kept[node] = grad_outputs

        return keep

    def stop_capturing(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def run(self, roots: Sequence[torch.Tensor], grads_out: Sequence[torch.Tensor | None] | None) -> None:
        """Accumulate the parameters' gradients, group by group, from the gradients kept at their
        junctions (each junction's incoming gradient replaced by the one it kept, where a group has
        several); where a parameter's gradient does not pass the inputs' chain (or the chunk has no
        input needing one), from ``roots`` with ``grads_out`` as a whole backward."""
        if self.replay:
            if self.params:
                torch.autograd.backward(roots, grads_out, inputs=self.params)
            return
        try:
            for group in self.groups:
                self._run_group(group)
        finally:
            self.kept.clear()
            self.groups = []

    def _run_group(self, group: _Group) -> None:
        edges, grads, handles = [], [], []
        for node in group.junctions:
            kept = self.kept.get(node, ())
            for i, grad in enumerate(kept):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
            if len(group.junctions) > 1 and kept:
                handles.append(node.register_prehook(lambda _, kept=kept: kept))
        try:
            if edges:  # only the paths from these junctions to these parameters run
                torch.autograd.backward(edges, grads, inputs=group.params)
        finally:
            for handle in handles:
                handle.remove()
