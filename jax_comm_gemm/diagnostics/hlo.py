"""Counting collectives in compiled HLO: how the routing shows in the program.
A synchronous collective and an async start count alike, and each operand of a
combined instruction counts as one; a collective-permute or an all-to-all
counts once (the operands of a tuple all-to-all are its chunks, those of a
collective-permute past the first are buffers and offsets). The fused ops are custom calls to the FFI
targets of ``runtime.constants``; Mosaic GPU custom calls (jax's Pallas kernel
among them) count apart, as do collectives over groups of one device, which
XLA's CPU compiler keeps and its GPU compiler removes (``single_device``)."""

from __future__ import annotations

import dataclasses
import re

from jax_comm_gemm.runtime.constants import TARGETS

# Mosaic GPU's custom-call targets start so ("mosaic_gpu_v2" in jax 0.11.2).
MOSAIC_GPU_TARGET = "mosaic_gpu"
# One HLO instruction per line: "  name = type opcode(operands), attrs".
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*.*?\s([a-z][a-z0-9-]*)\(", re.M)
# The collectives counted, with their async starts ("-done" carries no operands).
_COLLECTIVES = ("all-gather", "all-gather-start", "reduce-scatter", "reduce-scatter-start",
                "all-reduce", "all-reduce-start", "all-to-all", "ragged-all-to-all",
                "collective-broadcast")
# Point-to-point (the ring's ppermutes): no replica groups, never "single device".
_PERMUTES = ("collective-permute", "collective-permute-start")
# replica_groups as a list ({{0,1},{2,3}}) or in iota form ([4,2]<=[8], groups of 2).
_GROUP_LIST = re.compile(r"replica_groups=\{\{([^}]*)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[(?:\d+,)*?(\d+)\]<=")


@dataclasses.dataclass(frozen=True)
class CollectiveCounts:
  """How many of each collective a compiled program holds.

  >>> CollectiveCounts(all_gather=1, reduce_scatter=2, all_reduce=0,
  ...                  fused_all_gather_matmul=0, fused_matmul_reduce_scatter=0).all_gather
  1
  """
  all_gather: int
  reduce_scatter: int
  all_reduce: int
  fused_all_gather_matmul: int
  fused_matmul_reduce_scatter: int
  mosaic_gpu_kernels: int = 0  # Pallas Mosaic GPU kernels, the AllGather+GEMM's among them
  single_device: int = 0  # collectives over groups of one device: in none of the above
  collective_permute: int = 0  # lax.ppermute: the ring's steps
  all_to_all: int = 0  # all-to-all and ragged all-to-all instructions
  collective_broadcast: int = 0


def _opcodes(hlo_text: str) -> list[tuple[str, str]]:
  """(opcode, whole line) of every instruction."""
  out = []
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      out.append((m.group(1), line))
  return out


def count_collectives(hlo_text: str, scope: str | None = None) -> CollectiveCounts:
  """Counts in compiled HLO text, optionally only instructions whose metadata
  op_name contains `scope` (a ``jax.named_scope``).

  >>> text = "  %ag = f32[8,4]{1,0} all-gather(f32[4,4]{1,0} %x), replica_groups={{0,1}}"
  >>> count_collectives(text).all_gather
  1
  """
  ops = [(op, line) for op, line in _opcodes(hlo_text)
         if scope is None or scope in _op_name(line)]
  single = [(op, line) for op, line in ops if _single_device(op, line)]
  ops = [(op, line) for op, line in ops if not _single_device(op, line)]

  def n(*names):
    return sum(_operand_count(line, op) for op, line in ops if op in names)

  def calls(target, prefix=False):
    quoted = f'custom_call_target="{target}' + ("" if prefix else '"')
    return sum(op == "custom-call" and quoted in line for op, line in ops)

  return CollectiveCounts(
      all_gather=n("all-gather", "all-gather-start"),
      reduce_scatter=n("reduce-scatter", "reduce-scatter-start"),
      all_reduce=n("all-reduce", "all-reduce-start"),
      fused_all_gather_matmul=(calls(TARGETS["all_gather_matmul"])
                               + calls(TARGETS["fp8_all_gather_matmul"])),
      fused_matmul_reduce_scatter=(calls(TARGETS["matmul_reduce_scatter"])
                                   + calls(TARGETS["fp8_matmul_reduce_scatter"])),
      mosaic_gpu_kernels=calls(MOSAIC_GPU_TARGET, prefix=True),
      single_device=sum(_operand_count(line, op) for op, line in single),
      collective_permute=sum(op in _PERMUTES for op, _ in ops),
      all_to_all=sum(op in ("all-to-all", "ragged-all-to-all") for op, _ in ops),
      collective_broadcast=n("collective-broadcast"))


def compiled_collectives(fn, *args, scope: str | None = None) -> CollectiveCounts:
  """Compiles ``fn`` (a jitted function) for `args` and counts its collectives.

  >>> import jax, jax.numpy as jnp
  >>> compiled_collectives(jax.jit(lambda x: x * 2), jnp.ones(3)).all_reduce
  0
  """
  return count_collectives(fn.lower(*args).compile().as_text(), scope)


def _operand_count(line: str, opcode: str) -> int:
  """Top-level operands of `opcode(...)` on `line` (shapes hold commas too)."""
  start = line.index(opcode + "(") + len(opcode) + 1
  depth, count, seen = 0, 1, False
  for ch in line[start:]:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0:
        return count if seen else 0
      depth -= 1
    elif ch == "," and depth == 0:
      count += 1
    elif not ch.isspace():
      seen = True
  return count


def _single_device(opcode: str, line: str) -> bool:
  return opcode in _COLLECTIVES and _group_size(line) == 1


def _group_size(line: str) -> int | None:
  """Devices in each of the instruction's replica groups; None where the
  groups are not written out (``replica_groups={}``: every device)."""
  m = _GROUP_LIST.search(line)
  if m:
    return len(m.group(1).split(","))
  m = _GROUP_IOTA.search(line)
  return int(m.group(1)) if m else None


def _op_name(line: str) -> str:
  m = re.search(r'op_name="([^"]*)"', line)
  return m.group(1) if m else ""
