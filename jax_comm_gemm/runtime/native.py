"""Loads the C++ extension, after the libraries it links against: cuBLASMp, NCCL
and the CUDA runtime, by path from the NVIDIA wheels' ``nvidia`` namespace
package (or from the system), so no library path is set by hand. Where they
cannot load (no GPU driver) the reason is reported, never raised."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from types import MappingProxyType, ModuleType

EXTENSION = "jax_comm_gemm._comm_gemm"
CONSTANTS_EXTENSION = "jax_comm_gemm._constants"

# Relative to each entry of nvidia.__path__, in load order.
_LIBRARIES = MappingProxyType({
    13: ("cu13/lib/libcudart.so.13", "cu13/lib/libcublasLt.so.13", "nccl/lib/libnccl.so.2",
         "cublasmp/cu13/lib/libcublasmp.so.0"),
    12: ("cuda_runtime/lib/libcudart.so.12", "cublas/lib/libcublasLt.so.12",
         "nccl/lib/libnccl.so.2", "cublasmp/cu12/lib/libcublasmp.so.0"),
})


def _nvidia_dirs() -> list[str]:
  try:
    return list(importlib.import_module("nvidia").__path__)
  except ImportError:
    return []


def _preload(cuda_major: int) -> list[str]:
  """Loads each library from the first wheel that has it; others are left to
  the extension's own NEEDED entries and rpath. Returns the ones no wheel has."""
  absent = []
  for relative in _LIBRARIES.get(cuda_major, ()):
    for base in _nvidia_dirs():
      path = os.path.join(base, relative)
      if os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        break
    else:
      absent.append(os.path.basename(relative))
  return absent


def built() -> bool:
  """Whether the cuBLASMp extension was built (it may still fail to load)."""
  return importlib.util.find_spec(EXTENSION) is not None


def load() -> tuple[ModuleType | None, str]:
  """The extension module and "", or None and why it is unavailable."""
  if not built():
    return None, ("the C++ extension is not built (a CPU-only install, jcg.cuda=none, or "
                  "a source tree not installed): pip install \".[cuda13]\" builds it "
                  "(README, Installation)")
  absent: list[str] = []
  try:
    build_config = importlib.import_module("jax_comm_gemm._build_config")
    absent = _preload(build_config.CUDA_MAJOR)
    return importlib.import_module(EXTENSION), ""
  except (ImportError, OSError) as e:
    hint = ""
    if absent:
      cuda = build_config.CUDA_MAJOR
      hint = (f" (it was built for CUDA {cuda}, and no NVIDIA wheel here has "
              f"{', '.join(absent)}: install the cuda{cuda} extra, or rebuild with "
              f"-C jcg.cuda=<the CUDA installed>)")
    return None, f"the C++ extension did not load: {e}{hint}"


def load_constants() -> ModuleType | None:
  """The extension's constants module (no GPU needed), or None if not built."""
  if importlib.util.find_spec(CONSTANTS_EXTENSION) is None:
    return None
  return importlib.import_module(CONSTANTS_EXTENSION)
