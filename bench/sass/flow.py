"""The control flow of one SASS function (`bench.sass.model` parses it), as a converged
warp runs it: basic blocks, dominators, natural loops, and the paths a thread takes
through them.

* Divergent-warp fallbacks: ptxas guards warp-synchronous code (shuffles) with
  `BRA.DIV` and places a copy for a divergent warp out of line. A converged warp
  never takes those branches, so `Flow` leaves the blocks reached only through
  them out of every count and reports their size (`Flow.fallback`).
* Loops are natural loops of the control-flow graph (a branch back to a block
  that dominates it), not address ranges: a cold block placed after the function
  that branches back into a loop is no loop of its own.
* Paths (`Flow.through`, `Flow.hot_path`): with every back edge removed the blocks
  form a directed acyclic graph, whose shortest and longest paths, weighted by the
  blocks' instruction counts, bound what a thread runs when each loop but one is
  taken once and that one is counted apart.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .model import Function, Instruction

#: opcodes that end a basic block
CONTROL = frozenset({"BRA", "BRX", "JMP", "JMX", "EXIT", "RET"})


@dataclass(frozen=True)
class Loop:
    """A natural loop: its header block's first address, its instructions (the blocks
    of the loop, in address order), and the indices in its `Flow` of those blocks and
    of the header block."""

    header: int
    instructions: tuple
    blocks: frozenset
    head: int

    def count(self, matches: Callable[[Instruction], bool]) -> int:
        """How many of its instructions `matches`."""
        return sum(1 for ins in self.instructions if matches(ins))


class Span(NamedTuple):
    """The fewest and the most instructions on the paths between two points."""

    shortest: int
    longest: int


class Flow:
    """The control flow of one function, as a converged warp runs it.

    blocks: [start, end) index ranges; executed: the instructions of blocks reached
    from the entry without taking a `BRA.DIV` (address order); fallback: the rest
    that is not the padding after the last instruction (divergent-warp copies);
    loops: natural loops over the executed blocks, one per header."""

    def __init__(self, function: Function):
        self.function = function
        code = function.instructions
        self.blocks = _blocks(function)
        self._block_of = {start: b for b, (start, _) in enumerate(self.blocks)}
        self.successors = [self._successors(b) for b in range(len(self.blocks))]
        self.reached = _reach(self.successors, divergent=False)
        anyhow = _reach(self.successors, divergent=True)
        self._predecessors = {b: [p for p in self.reached for s, divergent in self.successors[p]
                                  if s == b and not divergent] for b in self.reached}
        self.executed = [code[i] for b in sorted(self.reached) for i in range(*self.blocks[b])]
        self.fallback = [code[i] for b in sorted(anyhow - self.reached)
                         for i in range(*self.blocks[b])]
        self._dominators = _dominators(self._predecessors)
        self.loops = self._natural_loops()

    def _successors(self, b: int) -> list[tuple[int, bool]]:
        """(block, divergent) pairs: where block `b` may go next."""
        start, end = self.blocks[b]
        last = self.function.instructions[end - 1]
        after = [(self._block_of[end], False)] if end in self._block_of else []
        if last.base not in CONTROL:
            return after
        conditional = (last.guard not in (None, "PT") or "DIV" in last.opcode.split(".")
                       or re.match(r"!?U?P\d", last.operands) is not None)
        taken = []
        if last.base == "BRA" and last.target in self.function.labels:
            taken = [(self._block_of[self.function.labels[last.target]],
                      last.opcode.startswith("BRA.DIV"))]
        return taken + (after if conditional else [])

    def _forward(self, b: int) -> list[int]:
        """The converged successors of block `b` but along back edges."""
        return [s for s, divergent in self.successors[b]
                if not divergent and s not in self._dominators[b]]

    def _natural_loops(self) -> list[Loop]:
        bodies: dict[int, set[int]] = {}
        for b in self.reached:
            for s, divergent in self.successors[b]:
                if not divergent and s in self._dominators[b]:      # a back edge b -> s
                    bodies.setdefault(s, {s}).update(self._reaching(b, s))
        code = self.function.instructions
        return [Loop(code[self.blocks[h][0]].address,
                     tuple(code[i] for b in sorted(body) for i in range(*self.blocks[b])),
                     frozenset(body), h)
                for h, body in sorted(bodies.items())]

    def _reaching(self, latch: int, header: int) -> set[int]:
        """Blocks that reach `latch` without passing `header` (the loop's body)."""
        body, stack = {header, latch}, [latch] if latch != header else []
        while stack:
            for p in self._predecessors[stack.pop()]:
                if p not in body:
                    body.add(p)
                    stack.append(p)
        return body

    def main_loop(self, marks: Callable[[Instruction], bool]) -> Loop | None:
        """The loop holding the most instructions that `marks` (the loads or mmas a
        kernel streams), the smallest of equals (the inner of nested loops, the leaner
        of two copies, e.g. a loop over unmasked tiles beside one over masked tiles);
        None if no loop holds one."""
        holding = [loop for loop in self.loops if loop.count(marks)]
        return max(holding, key=lambda loop: (loop.count(marks), -len(loop.instructions)),
                   default=None)

    def _size(self, b: int) -> int:
        start, end = self.blocks[b]
        return end - start

    def through(self, loop: Loop) -> Span:
        """The instructions on the paths from the entry to an `EXIT` that pass through
        `loop`, but for `loop`'s own: every other loop taken once (its back edges
        removed), `loop` entered once and left (a thread's run of one trip of every
        other loop, the trips of `loop` counted apart)."""
        def step(b: int) -> list[int]:
            if b in loop.blocks:
                return sorted({s for inner in loop.blocks for s in self._forward(inner)
                               if s not in loop.blocks})
            return self._forward(b)

        def weight(b: int) -> int:
            return 0 if b in loop.blocks else self._size(b)

        ends = {b for b in self.reached if self.function.instructions[
            self.blocks[b][1] - 1].base == "EXIT"}
        into = _extremes(0, step, weight, {loop.head})
        out = _extremes(loop.head, step, weight, ends)
        if into is None or out is None:
            raise ValueError(f"no path from the entry to an EXIT passes the loop at "
                             f"{loop.header:#x}")
        return Span(into.shortest + out.shortest, into.longest + out.longest)

    def hot_path(self, loop: Loop) -> Span:
        """The instructions on one trip of `loop`: the paths from its header to a block
        that branches back to it, inside the loop (nested loops taken once)."""
        latches = {b for b in loop.blocks
                   if any(s == loop.head and not d for s, d in self.successors[b])}

        def step(b: int) -> list[int]:
            return [s for s in self._forward(b) if s in loop.blocks]

        found = _extremes(loop.head, step, self._size, latches)
        if found is None:
            raise ValueError(f"the loop at {loop.header:#x} has no path back to its header")
        return found


def _extremes(start: int, step: Callable[[int], list[int]], weight: Callable[[int], int],
              ends: set[int]) -> Span | None:
    """Fewest and most summed weights of the blocks on a path from `start` to a block
    of `ends` (both counted) over the acyclic `step`; None if none reaches one."""
    order: list[int] = []
    seen = {start}
    stack = [(start, iter(step(start)))]
    while stack:                              # post-order: a block after its successors
        b, successors = stack[-1]
        nxt = next((s for s in successors if s not in seen), None)
        if nxt is None:
            order.append(b)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(step(nxt))))
    best: dict[int, tuple[int, int]] = {}
    for b in order:                           # successors first
        options = [best[s] for s in step(b) if s in best]
        if b in ends:
            options.append((0, 0))
        if options:
            w = weight(b)
            best[b] = (w + min(o[0] for o in options), w + max(o[1] for o in options))
    if start not in best:
        return None
    return Span(*best[start])


def _blocks(function: Function) -> list[tuple[int, int]]:
    """[start, end) instruction ranges: a block starts at a label or after control flow."""
    code = function.instructions
    starts = {0, *function.labels.values()}
    starts.update(i + 1 for i, ins in enumerate(code) if ins.base in CONTROL)
    starts = sorted(s for s in starts if s < len(code))
    return list(zip(starts, starts[1:] + [len(code)]))


def _reach(successors, divergent: bool) -> set[int]:
    """Blocks reached from block 0, taking divergent (`BRA.DIV`) edges or not."""
    seen, stack = {0}, [0]
    while stack:
        for s, is_divergent in successors[stack.pop()]:
            if s not in seen and (divergent or not is_divergent):
                seen.add(s)
                stack.append(s)
    return seen


def _dominators(predecessors: dict[int, list[int]]) -> dict[int, set[int]]:
    """Each block's dominators, for the blocks reached from block 0 (`predecessors`:
    their converged predecessors): iterative data flow."""
    reached = set(predecessors)
    dominators = {b: set(reached) for b in reached}
    dominators[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in sorted(reached - {0}):
            new = set.intersection(*(dominators[p] for p in predecessors[b])) | {b}
            if new != dominators[b]:
                dominators[b], changed = new, True
    return dominators
