"""SASS snippets for the `bench.sass` tests, written in nvdisasm's format."""
from bench.sassmodel import Instruction, parse


def sass_text(body: str, name: str = "_ZN6kernelE") -> str:
    """A function as nvdisasm prints it: its labels, then `/*addr*/ instruction ;` lines."""
    return f"\t.section\t.text.{name},\"ax\",@progbits\n{name}:\n.text.{name}:\n{body}"


def listing(*lines: str) -> str:
    """`sass_text` of instructions 16 bytes apart; a line ending in ':' is a label."""
    out, address = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/  {line} ;")
            address += 16
    return sass_text("\n".join(out) + "\n")


def code(*lines: str) -> list[Instruction]:
    """Straight-line instructions, 16 bytes apart."""
    return parse(listing(*lines))[0].instructions
