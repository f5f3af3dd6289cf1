"""SASS as data, for `python -m kvnumba.bench.sass`: nvdisasm's text parsed into functions of
instructions, the registers an instruction reads and writes, backward data-flow
slices, and the waits on global memory of code run in order (`round_trips`). Each
function's control flow is `bench.sass.flow`'s.

Everything here is static: instruction counts, not cycles.

Register parsing knows the operand shapes the kvnumba kernels produce (register
pairs `R4.64`, `.WIDE` / `.64` / `.128` results, carry-out predicates, the
mma and ldmatrix fragment widths); an instruction of another shape is read by the
general rule: its first operand (and the predicates right after it) written, the
rest read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Sequence

#: "/*0150*/   @!P0 LDSM.16.M88.4 R4, [R23] ;" -> address, guard, opcode, operands
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@(!?U?P[T\d])\s+)?([A-Z][A-Z0-9_.]*)"
                         r"\s*(.*?)\s*;")
#: a label line: a local label (.L_x_12:) or a function (_ZN...:, $__internal_0_...:)
LABEL = re.compile(r"^([.$\w]+):\s*$")
#: the label a branch or call names: BRA `(.L_x_5)
TARGET = re.compile(r"`\(([^)]+)\)")
#: a register operand: R12, UR4, P3, UP0, PR (all predicates); `.64` / `.128`: a
#: pair or quad of registers. RZ, URZ, PT, UPT are constants and never match.
REGISTER = re.compile(r"(?<![\w$.])(U?R\d+|U?P\d|PR)(?:\.(64|128))?(?![\w$])")
#: a call to the 64-bit integer division or remainder subroutine (`//`, `%` on int64)
DIV64_CALL = re.compile(r"__cuda_sm\d+_(?:div|rem)_[su]64$")

#: opcodes (before the first dot) that write no register
NO_DESTINATION = frozenset({
    "ST", "STG", "STS", "STL", "RED", "REDG", "LDGSTS", "BAR", "BRA", "BRX", "JMP", "JMX",
    "EXIT", "RET", "CALL", "BSSY", "BSYNC", "WARPSYNC", "NOP", "MEMBAR", "DEPBAR",
    "ERRBAR", "CCTL", "LDGDEPBAR", "YIELD", "FENCE", "BPT", "KILL"})
#: stores: the last operand is the data
STORES = frozenset({"ST", "STG", "STS", "STL"})
#: opcodes whose first two operands are both destinations (a predicate and a register,
#: or two predicates)
TWO_DESTINATIONS = frozenset({"SHFL", "VOTE", "VOTEU", "PLOP3", "UPLOP3"})
#: float64 arithmetic (F64 conversions and MUFU.*64H are recognised by their suffixes)
FLOAT64_OPCODES = frozenset({"DADD", "DMUL", "DFMA", "DSETP", "DSET", "DMNMX", "DMMA"})
#: predicates an R2P writes, or a P2R reads, as `PR`
ALL_PREDICATES = tuple(f"P{i}" for i in range(7))


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: `@guard OPCODE operands`."""

    address: int
    opcode: str
    operands: str = ""
    guard: str | None = None        # "P0", "!P0": the instruction runs where it holds

    @property
    def base(self) -> str:
        """The opcode before its first modifier: "LDG" of "LDG.E.128.CONSTANT"."""
        return self.opcode.split(".")[0]

    @property
    def target(self) -> str | None:
        """The label a branch or call names."""
        found = TARGET.search(self.operands)
        return found.group(1) if found else None

    @cached_property
    def writes(self) -> frozenset:
        """Registers and predicates this instruction writes."""
        if self.base in NO_DESTINATION:
            return frozenset()
        operands = _split(self.operands)
        names = set()
        for i, operand in enumerate(operands[:_destination_count(self.base, operands)]):
            width = _destination_width(self.opcode) if i == 0 else 1
            names.update(_registers(operand, width))
        return frozenset(names)

    @cached_property
    def reads(self) -> frozenset:
        """Registers and predicates its operands read (not its guard: that is control)."""
        operands = _split(self.operands)
        skip = 0 if self.base in NO_DESTINATION else _destination_count(self.base, operands)
        names = set()
        sources = operands[skip:]
        for i, operand in enumerate(sources):
            names.update(_registers(operand, _source_width(self.opcode, i, len(sources))))
        return frozenset(names)

    @property
    def address_registers(self) -> frozenset:
        """Registers inside the memory operands (`[R23+0x10]`, `desc[UR4][R20.64]`)."""
        return frozenset(name for inner in re.findall(r"\[([^\]]*)\]", self.operands)
                         for name in _registers(inner, 1))


def _split(operands: str) -> list[str]:
    """Operands, without a branch or call target."""
    text = TARGET.sub("", operands)
    return [part.strip() for part in text.split(",") if part.strip()]


def _is_predicate(operand: str) -> bool:
    return re.fullmatch(r"!?U?P(\d|T)", operand) is not None


def _destination_count(base: str, operands: Sequence[str]) -> int:
    """How many leading operands are destinations: the first, the second for
    `TWO_DESTINATIONS`, the set-predicate family and a predicate-first LOP3, and
    otherwise any carry-out predicates right after the first (IADD3 R1, P0, ...)."""
    if not operands:
        return 0
    if base in TWO_DESTINATIONS or base.endswith("SETP") or (
            base in ("LOP3", "ULOP3") and _is_predicate(operands[0])):
        return min(2, len(operands))
    count = 1
    while count < len(operands) and _is_predicate(operands[count]):
        count += 1
    return count


def _destination_width(opcode: str) -> int:
    """Registers the first destination spans: mma and ldmatrix fragments, 128- and
    64-bit results."""
    parts = opcode.split(".")
    if parts[0] == "HMMA":
        return 4 if parts[2:3] == ["F32"] else 2       # HMMA.16816.F32[.BF16]: 4 floats
    if parts[0] == "LDSM":
        return int(parts[-1]) if parts[-1].isdigit() else 1
    if "128" in parts:
        return 4
    if ("64" in parts or "WIDE" in parts or parts[0] in FLOAT64_OPCODES or "F64" in parts[1:2]
            or (parts[0] == "CS2R" and "32" not in parts)):
        return 2
    return 1


def _source_width(opcode: str, index: int, count: int) -> int:
    """Registers source `index` (of `count`) spans, where its operand does not say:
    the data of a 64- or 128-bit store, the 64-bit addend of IMAD.WIDE, float64
    operands, the mma fragments."""
    parts = opcode.split(".")
    if parts[0] in STORES and index == count - 1:
        return 4 if "128" in parts else 2 if "64" in parts else 1
    if parts[0] == "HMMA":
        return (4, 2, _destination_width(opcode))[min(index, 2)]
    if parts[0] in FLOAT64_OPCODES:
        return 2
    if "WIDE" in parts and index == count - 1:
        return 2
    return 1


def _registers(operand: str, width: int) -> list[str]:
    """The registers an operand names: `R4.64` -> R4, R5; a plain R4 of `width` 4 -> R4..R7."""
    names = []
    for name, suffix in REGISTER.findall(operand):
        if name == "PR":
            names.extend(ALL_PREDICATES)
            continue
        prefix, number = re.fullmatch(r"(U?[RP])(\d+)", name).groups()
        span = {"64": 2, "128": 4}.get(suffix, width if prefix.endswith("R") else 1)
        names.extend(f"{prefix}{int(number) + k}" for k in range(span))
    return names


# --- functions ----------------------------------------------------------------------------

@dataclass
class Function:
    """A function of a cubin's SASS (the kernel, or a subroutine it calls)."""

    name: str
    instructions: list = field(default_factory=list)
    labels: dict = field(default_factory=dict)      # label -> index of its instruction


def parse(sass: str) -> list[Function]:
    """nvdisasm's text as functions, the kernel first. A label that is not local
    (`.L...`) nor a section (`.text....`) starts a function."""
    functions: list[Function] = []
    pending: list[str] = []
    for line in sass.splitlines():
        label = LABEL.match(line)
        if label:
            name = label.group(1)
            if name.startswith(".text."):
                continue
            if not name.startswith(".L"):
                functions.append(Function(name))
                pending = []
            pending.append(name)
            continue
        found = INSTRUCTION.match(line)
        if found and functions:
            address, guard, opcode, operands = found.groups()
            function = functions[-1]
            for name in pending:
                function.labels[name] = len(function.instructions)
            pending = []
            function.instructions.append(Instruction(int(address, 16), opcode, operands, guard))
    return functions


def all_instructions(functions: Iterable[Function]) -> list[Instruction]:
    """Every instruction of every function."""
    return [ins for function in functions for ins in function.instructions]


# --- data flow ----------------------------------------------------------------------------

def backward_slice(code: Sequence[Instruction], start: int, registers: Iterable[str], *,
                   wrap: bool) -> set[int]:
    """Indices of the instructions of `code` that compute `registers` as `code[start]`
    reads them: walking back from `start - 1` (and, with `wrap`, on from the end of
    `code` down to `start + 1`: once around a loop, for loop-carried values).

    Walked in address order, as straight-line code, over data operands (a guard is
    control, not data). Each wanted register remembers the guard under which it is
    wanted (that of `code[start]`, then of the instruction that reads it): a write
    under that same guard replaces it, a write under another guard may not happen
    and leaves it wanted. Once the walk passes the guard predicate's own definition,
    the guard no longer names the same condition and only an unguarded write counts.
    """
    wanted = dict.fromkeys(registers, code[start].guard)    # register -> guard or None
    found: set[int] = set()
    order = list(range(start - 1, -1, -1))
    if wrap:
        order += range(len(code) - 1, start, -1)
    for i in order:
        if not wanted:
            break
        ins = code[i]
        hits = ins.writes & wanted.keys()
        if hits:
            found.add(i)
            guards = {wanted[name] for name in hits}
            for name in hits:
                if ins.guard is None or ins.guard == wanted[name]:
                    del wanted[name]
            guard = ins.guard or (guards.pop() if len(guards) == 1 else None)
            for name in ins.reads:
                wanted[name] = guard if wanted.get(name, guard) == guard else None
        for name, guard in wanted.items():
            if guard is not None and guard.lstrip("!") in ins.writes:
                wanted[name] = None
    return found


def address_slice(code: Sequence[Instruction], marks: Callable[[Instruction], bool]) -> set[int]:
    """The instructions of loop body `code` that compute the addresses of the
    instructions `marks` selects: the union of their backward slices, once around."""
    return set().union(*(backward_slice(code, i, ins.address_registers, wrap=True)
                         for i, ins in enumerate(code) if marks(ins)))


def is_global_load(ins: Instruction) -> bool:
    return ins.base in ("LDG", "LD")


def round_trips(code: Iterable[Instruction]) -> int:
    """The waits on global memory of `code` run in order, one instruction after the
    other: a load's destination registers are outstanding from its issue, and an
    instruction that reads one of them while it is outstanding waits for that load
    (one round trip). Loads issued before that first use travel together with the
    one waited for, so the wait settles every outstanding load. A register written
    again (unguarded) before its first use is no longer the load's. 8 loads, each
    used before the next is issued: 8 round trips; 8 loads issued, then used: 1."""
    outstanding: set[str] = set()
    waits = 0
    for ins in code:
        if outstanding & ins.reads:
            waits += 1
            outstanding.clear()
        if is_global_load(ins):
            outstanding |= ins.writes
        elif ins.guard is None:
            outstanding -= ins.writes
    return waits


def load_bytes(ins: Instruction) -> int:
    """Bytes a lane's global load reads: 16 (`.128`), 8 (`.64`), 2 (`.U16` / `.S16`), 1
    (`.U8` / `.S8`), else 4."""
    parts = ins.opcode.split(".")
    for part, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if part in parts:
            return size
    return 4


def most_in_flight(code: Iterable[Instruction]) -> int:
    """The most bytes a lane's global loads have outstanding at once over `code` run in
    order, as `round_trips` walks it: a load adds its bytes (`load_bytes`), a wait (an
    instruction reading an outstanding load's register) settles them all."""
    outstanding: dict[str, int] = {}
    most = 0
    for ins in code:
        if outstanding.keys() & ins.reads:
            outstanding.clear()
        if is_global_load(ins):
            for name in ins.writes:
                outstanding[name] = 0
            first = min(ins.writes, default=None)
            if first is not None:
                outstanding[first] = load_bytes(ins)
        elif ins.guard is None:
            for name in ins.writes:
                outstanding.pop(name, None)
        most = max(most, sum(outstanding.values()))
    return most


# --- instruction classes -------------------------------------------------------------------

def is_float64(ins: Instruction) -> bool:
    """float64 arithmetic, a conversion from or to float64 (F2F.F64.F32, I2F.F64.S64,
    F2I.S64.F64, ...), a float64 MUFU, or a call to a float64 subroutine."""
    parts = ins.opcode.split(".")
    return (ins.base in FLOAT64_OPCODES or "F64" in parts[1:]
            or (ins.base == "MUFU" and any(p.endswith("64H") for p in parts))
            or (ins.base == "CALL" and "f64" in (ins.target or "")))


def is_div64_call(ins: Instruction) -> bool:
    """A call to the 64-bit integer division or remainder subroutine."""
    return ins.base == "CALL" and DIV64_CALL.search(ins.target or "") is not None
