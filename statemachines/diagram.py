"""Mermaid state diagrams generated from a `MachineSpec` (the docs commit their output)."""
from .spec import RESTORE, MachineSpec


def mermaid(spec: MachineSpec) -> str:
    """A `stateDiagram-v2` of `spec`, one edge per (source, event)."""
    lines = ["stateDiagram-v2", f"    [*] --> {spec.initial}"]
    for t in spec.transitions:
        for source in t.sources:
            if t.dest == RESTORE:
                restored_from = next(u for u in spec.transitions if u.event == t.restores).sources
                for earlier in restored_from:
                    lines.append(f"    {source} --> {earlier}: {t.event} (was {earlier} "
                                 f"before {t.restores})")
            else:
                lines.append(f"    {source} --> {t.dest}: {t.event}")
    return "\n".join(lines) + "\n"
