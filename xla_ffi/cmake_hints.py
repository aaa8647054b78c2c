"""Prints CMake `set()` lines: where this interpreter's jax, nanobind and NVIDIA
wheels keep their headers and libraries. CMakeLists.txt includes the output and
still finds each file itself, so system installs (CUDA_HOME, NCCL_HOME,
CUBLASMP_HOME) work too."""

import importlib
import os
import sys


def _dirs(package):
  try:
    return list(importlib.import_module(package).__path__)
  except ImportError:
    return []


def main():
  lines = []
  try:
    import jax.ffi  # noqa: PLC0415

    lines.append(f'set(JCG_XLA_FFI_INCLUDE_DIR "{jax.ffi.include_dir()}")')
  except ImportError as e:
    print(f"jax is not importable ({e})", file=sys.stderr)
  try:
    import nanobind  # noqa: PLC0415

    lines.append(f'set(nanobind_DIR "{nanobind.cmake_dir()}")')
  except ImportError:
    pass
  includes, libraries = [], []
  for base in _dirs("nvidia"):
    for sub in ("cu13", "cu12", "cuda_runtime", "cublas", "nccl",
                "cublasmp/cu13", "cublasmp/cu12"):
      includes.append(os.path.join(base, sub, "include"))
      libraries.append(os.path.join(base, sub, "lib"))
  existing = lambda paths: ";".join(p for p in paths if os.path.isdir(p))
  lines.append(f'set(JCG_INCLUDE_HINTS "{existing(includes)}")')
  lines.append(f'set(JCG_LIBRARY_HINTS "{existing(libraries)}")')
  print("\n".join(lines))


if __name__ == "__main__":
  main()
