"""The refusals of the cache's verbs, as typed errors whose messages name the numbers and
the fix (contract §9). Each function builds the error; the caller raises it, having
changed nothing."""
from __future__ import annotations

import numpy as np

from .config import CacheConfig
from .errors import (CapacityError, OwnerRunError, PositionError, RingFloorError,
                     StepProtocolError)


def split_hint(config: CacheConfig) -> str:
    """What to do with an input longer than `max_write`."""
    return (f"split it into chunks of at most max_write={config.max_write} tokens, one "
            f"step each")


def floor_refusal(verb: str, seq: int, target: int, high_water: int,
                  config: CacheConfig) -> RingFloorError:
    """A rewind or clone of sequence `seq` to `target`, below its floor: names the target,
    the floor, and the ring layer that sets it (its window or chunk and rows, what it
    still holds)."""
    floor, layer = config.floor_of(high_water)
    kind = config.kinds[layer]
    rows = int(config.ring_rows()[layer])
    return RingFloorError(f"{verb}: target position {target} is below the floor {floor} of "
                          f"sequence {seq}: {kind.name} layer {layer} ({kind.describe()}, "
                          f"{rows} rows) holds only positions [{high_water - rows}, "
                          f"{high_water}) at high-water {high_water}, and resuming at p needs "
                          f"{kind.resume_needs()}; go back no further than {floor}")


def position_refusal(target: str, seq: int, lowest: int, pos: int) -> PositionError:
    """A target (`target`: the verb and the position it was given) outside `[lowest,
    pos]` of sequence `seq`."""
    return PositionError(f"{target} outside [{lowest}, {pos}] for sequence {seq}")


def write_refusal(seq: int, tokens: int, config: CacheConfig) -> CapacityError:
    """A sequence writing more than `max_write` tokens in one step."""
    return CapacityError(f"declare_step: sequence {seq} writes {tokens} tokens, more than "
                         f"max_write {config.max_write}; {split_hint(config)}")


def capacity_refusal(seq: int, pos: int, tokens: int, config: CacheConfig) -> CapacityError:
    """A sequence at `pos` whose `tokens` would pass `capacity`."""
    return CapacityError(f"declare_step: sequence {seq} at pos {pos} + {tokens} tokens "
                         f"exceeds capacity {config.capacity}")


def step_refusal(n_tokens: int, config: CacheConfig) -> CapacityError:
    """A step of more than `max_step` tokens."""
    return CapacityError(f"declare_step: {n_tokens} tokens exceed max_step {config.max_step}")


def owner_refusal(seq: int, runs: list) -> OwnerRunError:
    """A draft-block owner with no span, or with several (`runs`: their token ranges)."""
    if not runs:
        return OwnerRunError(f"declare_step: blocks name sequence {seq}, which has no run in "
                             f"this step; a draft block must be exactly one run")
    return OwnerRunError(f"declare_step: block owner {seq} has {len(runs)} runs {runs} "
                         f"(token ranges); a draft block must be exactly one run")


def width_refusal(width: int, n_tokens: int, config: CacheConfig) -> CapacityError:
    """A `prepare_step` width outside `[n_tokens, max_step]`."""
    return CapacityError(f"prepare_step: width {width} outside [n_tokens {n_tokens}, max_step "
                         f"{config.max_step}]")


def half_written_refusal(written: np.ndarray, storing: np.ndarray) -> StepProtocolError:
    """A `commit_step` of a step that wrote some of the layers that store (`storing`,
    bool per layer) and not others (`written`, bool per layer)."""
    return StepProtocolError(f"commit_step: the step wrote layers "
                             f"{np.flatnonzero(written & storing).tolist()} but not "
                             f"{np.flatnonzero(~written & storing).tolist()}; write every "
                             f"layer that stores K/V before commit_step(), or abort_step() "
                             f"to discard the step")


def unrun_state_refusal(ran: np.ndarray, absent: np.ndarray) -> StepProtocolError:
    """A `commit_step` of a step that ran some layers and left a state layer's part unrun
    (`ran`, bool `[n_layers, 2]`: conv, recurrent; `absent`: the parts layers lack)."""
    missing = [f"{'conv' if part == 0 else 'delta_rule/ssd'}({layer})"
               for layer, part in zip(*np.nonzero(~ran & ~absent))]
    return StepProtocolError(f"commit_step: the step ran other layers but not "
                             f"{', '.join(missing)}; run every state layer's parts before "
                             f"commit_step(), or abort_step() to discard the step")


def unprepared_refusal(verb: str, state) -> StepProtocolError:
    """Data moving outside a prepared step (`state`: the step's `StepState`)."""
    return StepProtocolError(f"{verb}: the step is {state.name}; data moves only inside a "
                             f"prepared step (declare_step, then prepare_step)")


def width_hint(step, *arrays) -> str:
    """Why an array with one row per token does not fit `step`, a padded step, or ''."""
    n_tokens, width = step.n_tokens, step.width
    if width == n_tokens or not any(getattr(a, "shape", (None,))[:1] == (n_tokens,)
                                    for a in arrays):
        return ""
    return (f"; the step was prepared with prepare_step(width={width}) for {n_tokens} "
            f"tokens: pass {width} rows (the last {width - n_tokens} are padding)")
