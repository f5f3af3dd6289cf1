"""SASS snippets for the `bench.sass` tests, written in nvdisasm's format."""
from kvnumba.bench.sass.model import Instruction, parse


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


#: a token loop (header .L_x_0) around a vector loop (.L_x_2) of one K and one V vector a
#: trip (7 instructions): an early exit, a token skipped (.L_x_3), a ring's row
#: (0x80..0xa0) skipped on a flat layer (.L_x_1). On the way through it 13 instructions
#: on a flat layer, 16 through the ring's row.
TOKEN_LOOP = (
    "S2R R0, SR_TID.X", "ISETP.GE.AND P0, PT, R0, R9, PT", "@P0 EXIT",
    ".L_x_0:",
    "LDG.E R2, desc[UR4][R4.64]", "ISETP.GE.AND P1, PT, R2, RZ, PT", "@!P1 BRA `(.L_x_3)",
    "ISETP.NE.AND P2, PT, R8, RZ, PT", "@!P2 BRA `(.L_x_1)",
    "IMAD.HI.U32 R3, R2, R7, RZ", "IMAD R3, R3, R8, R2", "IADD3 R3, R3, -R8, RZ",
    ".L_x_1:",
    "MOV R6, RZ",
    ".L_x_2:",
    "LDG.E.128 R12, desc[UR4][R4.64]", "LDG.E.128 R16, desc[UR4][R4.64+0x100]",
    "STG.E.128 desc[UR4][R6.64], R12", "STG.E.128 desc[UR4][R6.64+0x100], R16",
    "IADD3 R6, R6, 0x1, RZ", "ISETP.LT.AND P3, PT, R6, R10, PT", "@P3 BRA `(.L_x_2)",
    ".L_x_3:",
    "IADD3 R0, R0, R11, RZ", "ISETP.LT.AND P0, PT, R0, R9, PT", "@P0 BRA `(.L_x_0)",
    "EXIT")
