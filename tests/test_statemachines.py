"""The compiled tables agree with the `transitions` machines on every (state, event)."""
import itertools

import pytest

import kvnumba.statemachines as sm
from kvnumba.statemachines import REFUSED, RESTORES, MachineModel, compile_machine

MACHINES = [sm.SLOT_LIFECYCLE, sm.STEP_PROTOCOL]


def _restore_sources(spec, event):
    """For a RESTORE event: the states it can return to (sources of the restored event)."""
    t = next(t for t in spec.transitions if t.event == event)
    return next(u for u in spec.transitions if u.event == t.restores).sources, t.restores


@pytest.mark.parametrize("spec", MACHINES, ids=lambda s: s.name)
def test_table_agrees_with_transitions_on_every_pair(spec):
    compiled = compile_machine(spec)
    for state, event in itertools.product(spec.states, spec.events):
        entry = int(compiled.table[compiled.state_index[state], compiled.event_index[event]])
        if entry == RESTORES:
            earlier_states, restored = _restore_sources(spec, event)
            for earlier in earlier_states:
                model = MachineModel(spec, initial=earlier)
                assert model.fire(restored), (earlier, restored)
                assert model.state == state
                assert model.fire(event)
                assert model.state == earlier, (state, event, earlier)
            continue
        model = MachineModel(spec, initial=state)
        moved = model.fire(event)
        if entry == REFUSED:
            assert not moved and model.state == state, (state, event)
        else:
            assert moved and model.state == spec.states[entry], (state, event)


def test_slot_lifecycle_is_the_contract():
    """contract §6, written out by hand."""
    expected = {
        ("free", "seq_new"): "claimed",
        ("free", "clone_into"): "committed",
        ("claimed", "declare"): "prefilling",
        ("committed", "declare"): "prefilling",
        ("rewound", "declare"): "prefilling",
        ("prefilling", "commit"): "committed",
        ("prefilling", "abort"): "<restore>",
        ("committed", "rewind"): "rewound",
        ("rewound", "rewind"): "rewound",
        ("claimed", "seq_rm"): "free",
        ("committed", "seq_rm"): "free",
        ("rewound", "seq_rm"): "free",
    }
    c = compile_machine(sm.SLOT_LIFECYCLE)
    for s, e in itertools.product(c.states, c.events):
        entry = int(c.table[c.state_index[s], c.event_index[e]])
        got = None if entry == REFUSED else ("<restore>" if entry == RESTORES else c.states[entry])
        assert got == expected.get((s, e)), (s, e)


def test_step_protocol_is_the_contract():
    c = compile_machine(sm.STEP_PROTOCOL)
    allowed = {("idle", "declare"): "declared", ("declared", "prepare"): "prepared",
               ("prepared", "commit"): "idle", ("declared", "abort"): "idle",
               ("prepared", "abort"): "idle"}
    for s, e in itertools.product(c.states, c.events):
        entry = int(c.table[c.state_index[s], c.event_index[e]])
        assert (None if entry == REFUSED else c.states[entry]) == allowed.get((s, e)), (s, e)


def test_declarations_reject_inconsistent_specs():
    with pytest.raises(ValueError, match="undeclared"):
        sm.MachineSpec("x", ("a",), "a", (sm.Transition("go", ("a",), "b"),))
    with pytest.raises(ValueError, match="twice"):
        sm.MachineSpec("x", ("a", "b"), "a", (sm.Transition("go", ("a",), "b"),
                                              sm.Transition("go", ("a",), "a")))


def test_mermaid_lists_every_edge():
    text = sm.mermaid(sm.SLOT_LIFECYCLE)
    assert text.startswith("stateDiagram-v2\n    [*] --> free\n")
    assert "    free --> claimed: seq_new" in text
    assert "    prefilling --> rewound: abort (was rewound before declare)" in text
    edges = [line for line in text.splitlines() if ": " in line]
    # 11 plain (source, event) edges plus abort's three restore targets
    assert len(edges) == 11 + 3


def test_states_print_as_names():
    import kvnumba as kv
    assert str(kv.StepState.PREPARED) == "PREPARED" and f"{kv.SlotState.FREE:>6}" == "  FREE"
    assert kv.StepState.IDLE == 0 and repr(kv.SlotState.REWOUND) == "<SlotState.REWOUND: 4>"
