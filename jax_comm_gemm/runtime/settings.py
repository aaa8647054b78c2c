"""The environment variables that steer the runtime, read and checked in one place.

Each reader raises a ValueError that names the variable and what it allows,
before any device work.
"""

from __future__ import annotations

import os
import warnings

from jax_comm_gemm.runtime.constants import FENCES, UNSAFE_FENCES

BACKEND = "JAX_COMM_GEMM_BACKEND"              # overrides every config's backend
FENCE = "JAX_COMM_GEMM_FENCE"                  # how calls are ordered against XLA
ALLOW_UNSAFE_FENCE = "JAX_COMM_GEMM_ALLOW_UNSAFE_FENCE"
CONNECT_TIMEOUT = "JAX_COMM_GEMM_CONNECT_TIMEOUT"  # seconds for communicator set-up
CALL_TIMEOUT = "JAX_COMM_GEMM_TIMEOUT"         # seconds a call may wait for its peers
ON_ABORT = "JAX_COMM_GEMM_ON_ABORT"            # "exit" (default) or "wait": sentinel.py
ABORT_GRACE = "JAX_COMM_GEMM_ABORT_GRACE"      # seconds between an abort and the exit
AUTOTUNE = "JAX_COMM_GEMM_AUTOTUNE"            # "on", "off", or an implementation to force
AUTOTUNE_CACHE = "JAX_COMM_GEMM_AUTOTUNE_CACHE"  # the JSON file of measured choices

BACKENDS = ("auto", "cublasmp", "xla", "ring")


def backend_override() -> str:
  """The backend $JAX_COMM_GEMM_BACKEND forces on every layer (for A/B runs),
  or "" when it is unset."""
  value = os.environ.get(BACKEND, "").strip().lower()
  if value and value not in BACKENDS:
    raise ValueError(f"environment variable {BACKEND}={value!r}: allowed values are "
                     f"{BACKENDS}")
  return value


def fence() -> str:
  """The fence new communicators take: $JAX_COMM_GEMM_FENCE, else the default.

  The unsafe ones (see constants.UNSAFE_FENCES) need
  $JAX_COMM_GEMM_ALLOW_UNSAFE_FENCE=1 and warn every time they are taken."""
  value = os.environ.get(FENCE, "").strip() or FENCES[0]
  if value not in FENCES:
    raise ValueError(f"{FENCE}={value!r} is not a fence; use one of {', '.join(FENCES)} "
                     f"(or leave it unset for {FENCES[0]!r})")
  if value in UNSAFE_FENCES:
    if os.environ.get(ALLOW_UNSAFE_FENCE) != "1":
      raise ValueError(
          f"{FENCE}={value!r} {UNSAFE_FENCES[value]} (xla_ffi/constants.h, Fence); it is "
          f"kept for investigation only: set {ALLOW_UNSAFE_FENCE}=1 to take it anyway")
    warnings.warn(f"jax_comm_gemm: {FENCE}={value!r} is unsafe: results can be wrong",
                  RuntimeWarning, stacklevel=3)
  return value


def _seconds(name: str, default: float) -> float:
  raw = os.environ.get(name, "").strip()
  if not raw:
    return default
  try:
    value = float(raw)
  except ValueError:
    value = -1.0
  if not value > 0:
    raise ValueError(f"environment variable {name}={raw!r} must be a positive number of "
                     f"seconds (default {default:g})")
  return value


def connect_timeout_s() -> float:
  return _seconds(CONNECT_TIMEOUT, 300.0)


def call_timeout_s() -> float:
  return _seconds(CALL_TIMEOUT, 300.0)


def on_abort() -> str:
  """What the sentinel does when a communicator was aborted: "exit" or "wait"."""
  value = os.environ.get(ON_ABORT, "").strip().lower() or "exit"
  if value not in ("exit", "wait"):
    raise ValueError(f"environment variable {ON_ABORT}={value!r}: allowed values are "
                     "('exit', 'wait')")
  return value


def abort_grace_s() -> float:
  return _seconds(ABORT_GRACE, 60.0)


def autotune(implementations) -> str:
  """$JAX_COMM_GEMM_AUTOTUNE: "on" (measure, the default), "off" (no
  measuring: the rule of thumb decides) or one of `implementations`, which
  backend="auto" then takes for every op that can run it."""
  value = _autotune_value()
  allowed = ("on", "off", *implementations)
  if value not in allowed:
    raise ValueError(f"environment variable {AUTOTUNE}={value!r}: allowed values are "
                     f"{allowed}")
  return value


def measuring() -> bool:
  """Whether anything is timed: autotune's choices, and the algorithm of each
  own GEMM (the fastest of cuBLASLt's candidates, at its plan's first call).
  Only $JAX_COMM_GEMM_AUTOTUNE=off turns both off; a forced implementation
  still has its GEMMs timed."""
  return _autotune_value() != "off"


def _autotune_value() -> str:
  return os.environ.get(AUTOTUNE, "").strip().lower() or "on"


def autotune_cache() -> str:
  """Where measured choices are kept between runs ("" keeps them in memory)."""
  default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "jax_comm_gemm", "autotune.json")
  return os.environ.get(AUTOTUNE_CACHE, default)
