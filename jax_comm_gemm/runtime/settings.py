"""The environment variables that steer the runtime: read, checked and frozen
once (:meth:`Settings.from_environ`; an unknown ``JAX_COMM_GEMM_*`` name is an
error too), at ``connect`` or at first use, into the routing plan: nothing
reads the environment while tracing (docs/design.md#routing-plan).

>>> Settings.from_environ({"JAX_COMM_GEMM_BACKEND": "xla"}).backend
'xla'
>>> Settings.from_environ({"JAX_COMM_GEMM_TIMEOUT": "-1"})
Traceback (most recent call last):
...
ValueError: environment variable JAX_COMM_GEMM_TIMEOUT='-1' must be a positive number of seconds (default 300)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from types import MappingProxyType

PREFIX = "JAX_COMM_GEMM_"
BACKEND = "JAX_COMM_GEMM_BACKEND"              # overrides every config's backend
CONNECT_TIMEOUT = "JAX_COMM_GEMM_CONNECT_TIMEOUT"  # seconds for communicator set-up
CALL_TIMEOUT = "JAX_COMM_GEMM_TIMEOUT"         # seconds a call may wait for its peers
ON_ABORT = "JAX_COMM_GEMM_ON_ABORT"            # "exit" (default) or "wait": sentinel.py
ABORT_GRACE = "JAX_COMM_GEMM_ABORT_GRACE"      # seconds between an abort and the exit
AUTOTUNE = "JAX_COMM_GEMM_AUTOTUNE"            # "on", "off", or an implementation to force
AUTOTUNE_CACHE = "JAX_COMM_GEMM_AUTOTUNE_CACHE"  # the JSON file of measured choices
VARIABLES = (BACKEND, CONNECT_TIMEOUT, CALL_TIMEOUT, ON_ABORT, ABORT_GRACE, AUTOTUNE,
             AUTOTUNE_CACHE)
# Variables of earlier versions, and why they are gone (docs/design.md#options-removed-and-why).
REMOVED = MappingProxyType({
    "JAX_COMM_GEMM_FENCE": "every cuBLASMp call is now ordered the one safe way (own "
                           "stream and a barrier); the other fences gave wrong results",
    "JAX_COMM_GEMM_ALLOW_UNSAFE_FENCE": "the unsafe fences are gone",
})

BACKENDS = ("auto", "cublasmp", "xla", "ring")
# What backend="auto" may choose from, by name (backends/routes.py's CANDIDATES
# holds the same names per op; a test compares them). Here so that
# JAX_COMM_GEMM_AUTOTUNE can be checked without importing the backends.
IMPLEMENTATIONS = ("cublasmp_default", "cublasmp_split_p2p", "pallas_mgpu", "pipelined_ce",
                   "ring", "xla")


def _default_cache() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(base, "jax_comm_gemm", "autotune.json")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every runtime setting, validated; hashable, so it can be part of a plan. One
  field per ``JAX_COMM_GEMM_*`` variable (README.md#configuration says what
  each does): ``backend`` (BACKEND), ``autotune`` and ``autotune_cache``,
  ``connect_timeout_s`` (CONNECT_TIMEOUT), ``call_timeout_s`` (TIMEOUT),
  ``on_abort`` and ``abort_grace_s``.

  >>> Settings.from_environ({"JAX_COMM_GEMM_AUTOTUNE": " OFF "}).measuring
  False
  """

  backend: str = ""
  autotune: str = "on"
  autotune_cache: str = dataclasses.field(default_factory=_default_cache)
  connect_timeout_s: float = 300.0
  call_timeout_s: float = 300.0
  on_abort: str = "exit"
  abort_grace_s: float = 60.0

  @classmethod
  def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Settings":
    """The settings `environ` (default ``os.environ``) asks for; a ValueError
    naming the variable for any bad value or unknown ``JAX_COMM_GEMM_*`` name."""
    env = os.environ if environ is None else environ
    for name in sorted(env):
      if name.startswith(PREFIX) and name not in VARIABLES:
        why = REMOVED.get(name)
        raise ValueError(
            f"environment variable {name} is not a jax_comm_gemm setting"
            + (f" any more: {why}" if why else "")
            + f"; the settings are {', '.join(VARIABLES)}")
    default = cls()
    return cls(
        backend=_choice(env, BACKEND, "", ("", *BACKENDS)),
        autotune=_choice(env, AUTOTUNE, "on", ("on", "off", *IMPLEMENTATIONS)),
        autotune_cache=_cache_file(env.get(AUTOTUNE_CACHE, default.autotune_cache)),
        connect_timeout_s=_seconds(env, CONNECT_TIMEOUT, default.connect_timeout_s),
        call_timeout_s=_seconds(env, CALL_TIMEOUT, default.call_timeout_s),
        on_abort=_choice(env, ON_ABORT, "exit", ("exit", "wait")),
        abort_grace_s=_seconds(env, ABORT_GRACE, default.abort_grace_s),
    )

  @property
  def measuring(self) -> bool:
    """Whether anything is timed: autotune's choices, and each own GEMM's
    algorithm (the fastest of cuBLASLt's candidates, at its plan's first
    call). Only ``JAX_COMM_GEMM_AUTOTUNE=off`` turns both off."""
    return self.autotune != "off"

  def fingerprint(self) -> dict[str, str]:
    """The settings every process of a group must share, by variable name:
    those that change what a rank enqueues or when it gives up on a peer.
    (Paths and the abort policy may differ per process.)"""
    return {BACKEND: self.backend, AUTOTUNE: self.autotune,
            CALL_TIMEOUT: f"{self.call_timeout_s:g}"}


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
  value = env.get(name, "").strip().lower() or default
  if value not in allowed:
    shown = tuple(a for a in allowed if a)
    raise ValueError(f"environment variable {name}={env[name]!r}: allowed values are "
                     f"{shown}, or leave it unset")
  return value


def _cache_file(path: str) -> str:
  """`path`, where autotune can write its choices: "" (in memory), or a file
  that is no directory and whose closest existing ancestor is a directory."""
  if not path:
    return path
  ancestor = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(ancestor):
    ancestor = os.path.dirname(ancestor)
  why = ("is a directory" if os.path.isdir(path) else
         None if os.path.isdir(ancestor) else f"is under {ancestor!r}, a file")
  if why:
    raise ValueError(f"environment variable {AUTOTUNE_CACHE}={path!r} {why}: it names the "
                     "JSON file of autotune's choices (or set it to '' to keep them in memory)")
  return path


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
  raw = env.get(name, "").strip()
  if not raw:
    return default
  try:
    value = float(raw)
  except ValueError:
    value = -1.0
  if not 0 < value < float("inf"):
    raise ValueError(f"environment variable {name}={raw!r} must be a positive number of "
                     f"seconds (default {default:g})")
  return value
