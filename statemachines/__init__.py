"""Declared state machines and their compiler. Knows nothing about caches.

- `SLOT_LIFECYCLE`, `STEP_PROTOCOL`: the declarations (data).
- `compile_machine(spec)`: a dense state x event table for batch validation.
- `MachineModel(spec)`: the same machine driven by the `transitions` package.
- `mermaid(spec)`: the diagram the docs commit.
"""
from .compiler import REFUSED, RESTORES, CompiledMachine, MachineModel, compile_machine
from .diagram import mermaid
from .lifecycle import CLONE_SOURCE_STATES, SLOT_LIFECYCLE, STEP_PROTOCOL
from .spec import RESTORE, MachineSpec, Transition

__all__ = ["CLONE_SOURCE_STATES", "CompiledMachine", "MachineModel", "MachineSpec", "REFUSED",
           "RESTORE", "RESTORES", "SLOT_LIFECYCLE", "STEP_PROTOCOL", "Transition",
           "compile_machine", "mermaid"]
