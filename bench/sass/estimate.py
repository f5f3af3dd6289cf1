"""A static estimate of decode attention on an NVIDIA H200 from a kernel's SASS figures:
how much of the memory's bandwidth a decode step of `SEQUENCES` sequences of `KEYS`
keys on `KV_HEADS` kv heads reaches, when its time is the longest of what its bytes,
its issued instructions and its tensor-core work take.

The chip (docs/benchmarks.md measured it): 132 SMs at 1.98 GHz, each issuing at most
one warp instruction per clock on each of its 4 schedulers; HBM3e of 4.8 TB/s, of
which a device-to-device copy moved 4.13 TB/s (`REACHED_BYTES`), the most a stream of
loads is taken to reach; `mma.sync m16n8k16` at one per 2 clocks per scheduler.

The estimate assumes what the kernel's static figures say and what its launch gives:
enough bytes in flight per SM to cover the memory's latency (the caller checks that
with `in_flight`), no bank conflicts, no tail of the last wave, and the combine's
partials (a few percent of the bytes) left out. It is an upper bound on what the
kernel can reach, not a measurement.
"""
from __future__ import annotations

from typing import NamedTuple

SMS = 132
CLOCK_HZ = 1.98e9
SCHEDULERS = 4
HBM_BYTES_PER_S = 4.8e12
REACHED_BYTES_PER_S = 4.13e12
HMMA_CLOCKS = 2
#: the decode step the targets name
SEQUENCES, KEYS, KV_HEADS = 128, 4096, 8
#: a latent layer's decode step: DeepSeek-V3's 128 query heads over its one latent head
LATENT_Q_HEADS, LATENT_KV_HEADS = 128, 1
#: loaded latency (seconds) the bytes in flight must cover
LATENCY_S = 1.0e-6
#: shared memory an SM gives its blocks, and the most blocks it holds
SHARED_PER_SM = 228 * 1024
BLOCKS_PER_SM = 32
#: registers of one SM's register file, the most one thread may hold, and the
#: allocation granule per thread
REGISTER_FILE = 65536
MAX_REGISTERS = 255
REGISTER_GRANULE = 8


#: an H100 SXM (the state layers' estimate, `state_step`): the same 132 SMs, clock,
#: schedulers, register file and shared memory, over HBM3 of 3.35 TB/s nominal, of which
#: a copy is taken to reach the fraction the H200's measured copy reached (4.13 / 4.8:
#: inferred, not measured on an H100)
H100_HBM_BYTES_PER_S = 3.35e12
H100_REACHED_BYTES_PER_S = H100_HBM_BYTES_PER_S * REACHED_BYTES_PER_S / HBM_BYTES_PER_S
#: a state layer's decode step: sequences of one token each, on this many heads of the
#: recurrence (Qwen3-Next's 32 value heads of 128 x 128)
STATE_HEADS = 32


class Estimate(NamedTuple):
    """Seconds the step's bytes, instructions and HMMAs take at the chip's rates, and
    the fraction of the HBM bandwidth (`HBM_BYTES_PER_S`) the step reaches."""

    bytes_s: float
    issue_s: float
    hmma_s: float

    @property
    def seconds(self) -> float:
        return max(self.bytes_s, self.issue_s, self.hmma_s)

    @property
    def hbm_fraction(self) -> float:
        return self.bytes_s * REACHED_BYTES_PER_S / HBM_BYTES_PER_S / self.seconds


def decode_step(instructions_per_key: float, hmma_per_key: float, head_dim: int,
                itemsize: int, *, planes: int = 2, kv_heads: int = KV_HEADS) -> Estimate:
    """The estimate of a decode step (module doc) of a kernel that issues
    `instructions_per_key` warp instructions and `hmma_per_key` HMMAs per key per kv
    head over K/V of `head_dim` values of `itemsize` bytes each (`planes`: K and V, or
    a latent layer's rows alone, 1), on `kv_heads` kv heads."""
    key_heads = SEQUENCES * KEYS * kv_heads
    issue_rate = SMS * SCHEDULERS * CLOCK_HZ
    return Estimate(bytes_s=key_heads * planes * head_dim * itemsize / REACHED_BYTES_PER_S,
                    issue_s=key_heads * instructions_per_key / issue_rate,
                    hmma_s=key_heads * hmma_per_key * HMMA_CLOCKS / issue_rate)


class StateStep(NamedTuple):
    """A state layer's decode step on an H100 (`state_step`): seconds its bytes and its
    issued instructions take, and the fraction of the HBM bandwidth it reaches."""

    bytes_s: float
    issue_s: float

    @property
    def seconds(self) -> float:
        return max(self.bytes_s, self.issue_s)

    @property
    def hbm_fraction(self) -> float:
        return self.bytes_s * H100_REACHED_BYTES_PER_S / H100_HBM_BYTES_PER_S / self.seconds


def state_step(bytes_per_head: float, instructions_per_head: float, *,
               heads: int = STATE_HEADS) -> StateStep:
    """The estimate of a decode step of `SEQUENCES` sequences of one token on `heads`
    heads of a state layer whose kernel moves `bytes_per_head` and issues
    `instructions_per_head` warp instructions per (sequence, head), on an H100: the
    longer of its bytes at `H100_REACHED_BYTES_PER_S` and its instructions at one per
    scheduler a clock."""
    pairs = SEQUENCES * heads
    return StateStep(bytes_s=pairs * bytes_per_head / H100_REACHED_BYTES_PER_S,
                     issue_s=pairs * instructions_per_head / (SMS * SCHEDULERS * CLOCK_HZ))


def blocks_per_sm(shared_bytes: int, registers: int, threads: int) -> int:
    """Blocks of `threads` threads, `shared_bytes` of shared memory and `registers` a
    thread (rounded up to the allocation granule) an SM holds at once."""
    allocated = -(-registers // REGISTER_GRANULE) * REGISTER_GRANULE
    return min(SHARED_PER_SM // shared_bytes, REGISTER_FILE // (allocated * threads),
               BLOCKS_PER_SM)


def in_flight(bytes_per_block: int, blocks_per_sm: int,
              reached: float = REACHED_BYTES_PER_S) -> float:
    """The bytes in flight per SM over those its share of `reached` (bytes a second,
    the H200's copy by default) needs to cover `LATENCY_S` (at least 1: the memory's
    latency is covered)."""
    return bytes_per_block * blocks_per_sm / (reached / SMS * LATENCY_S)


def tflops(step: Estimate, flops_per_key: float, kv_heads: int = KV_HEADS) -> float:
    """The useful arithmetic a step does a second, in TFLOP/s: `flops_per_key` per key per
    kv head (2 per multiply-add of Q K^T and P V over the rows), at the step's time."""
    return SEQUENCES * KEYS * kv_heads * flops_per_key / step.seconds / 1e12
