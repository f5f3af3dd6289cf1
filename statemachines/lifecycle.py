"""The two machines kvnumba validates (contract §6), declared once as data."""
from .spec import RESTORE, MachineSpec, Transition

SLOT_LIFECYCLE = MachineSpec(
    name="slot",
    states=("free", "claimed", "prefilling", "committed", "rewound"),
    initial="free",
    transitions=(
        Transition("seq_new", ("free",), "claimed"),
        Transition("clone_into", ("free",), "committed"),
        # "prefilling" means "in the open step"; a decode step is a one-token fill
        Transition("declare", ("claimed", "committed", "rewound"), "prefilling"),
        Transition("commit", ("prefilling",), "committed"),
        Transition("abort", ("prefilling",), RESTORE, restores="declare"),
        Transition("rewind", ("committed", "rewound"), "rewound"),
        Transition("seq_rm", ("claimed", "committed", "rewound"), "free"),
    ),
)

STEP_PROTOCOL = MachineSpec(
    name="step",
    states=("idle", "declared", "prepared"),
    initial="idle",
    transitions=(
        Transition("declare", ("idle",), "declared"),
        Transition("prepare", ("declared",), "prepared"),
        Transition("commit", ("prepared",), "idle"),
        Transition("abort", ("declared", "prepared"), "idle"),
    ),
)

#: the events that a slot must allow to be a clone source (it is read, not changed)
CLONE_SOURCE_STATES = ("committed", "rewound")
