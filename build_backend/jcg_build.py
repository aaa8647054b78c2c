"""The package's build backend: scikit-build-core, told which CUDA to build the
cuBLASMp extension against.

pip never passes a package's extras to its build backend, so ``pip install
".[cuda12]"`` cannot tell the build which headers to use. The choice is a build
setting instead, ``-C jcg.cuda=13|12|none`` (or the environment variable
``JCG_CUDA``); the default is 13:

  13, 12  the build environment gets the ``cuda13`` / ``cuda12`` extra's NVIDIA
          wheels (their headers and libraries), jax (its FFI headers) and
          nanobind, and CMake builds the extension; anything missing fails the
          build with its name (CMakeLists.txt);
  none    a pure-Python package, no CMake, nothing downloaded for the build: the
          XLA path only (CPU machines, or where cuBLASMp is not wanted).

Every PEP 517 / PEP 660 hook is scikit-build-core's, with the ``jcg.*`` settings
taken out and translated into its own."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

CHOICES = ("13", "12", "none")
DEFAULT = "13"
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def cuda_choice(config_settings: dict | None, environ: os._Environ | dict = os.environ) -> str:
  """The CUDA major to build against ("13", "12") or "none": ``-C jcg.cuda``,
  else ``JCG_CUDA``, else 13. Anything else is an error naming what is allowed."""
  value = (config_settings or {}).get("jcg.cuda")
  source = "-C jcg.cuda"
  if isinstance(value, list):
    value = value[-1]
  if value is None:
    value, source = environ.get("JCG_CUDA") or DEFAULT, "JCG_CUDA"
  value = str(value).strip().lower().removeprefix("cuda")
  if value == "cpu":
    value = "none"
  if value not in CHOICES:
    raise ValueError(f"jax-comm-gemm: {source} must be one of {', '.join(CHOICES)} "
                     f"(the CUDA major the cuBLASMp extension builds against, or none for a "
                     f"CPU-only package); got {value!r}")
  return value


def _skbuild_settings(config_settings: dict | None) -> dict:
  """The settings scikit-build-core gets: ours out, their translation in."""
  cuda = cuda_choice(config_settings)
  settings = {k: v for k, v in (config_settings or {}).items() if not k.startswith("jcg.")}
  if cuda == "none":
    settings["wheel.cmake"] = "false"
  else:
    settings["cmake.define.JCG_CUDA"] = cuda
  return settings


def build_requirements(cuda: str) -> list[str]:
  """What the build environment needs beyond scikit-build-core (and CMake and
  ninja, which it adds itself): for a CUDA build, nanobind, jax and the
  ``cuda<N>`` extra's NVIDIA wheels, read from pyproject.toml so the build and
  run-time versions come from one list."""
  if cuda == "none":
    return []
  project = tomllib.loads(_PYPROJECT.read_text())["project"]
  jax = [d for d in project["dependencies"] if d.split(">")[0].split("=")[0].strip() == "jax"]
  return ["nanobind>=2.4", *jax, *project["optional-dependencies"][f"cuda{cuda}"]]


def _skbuild():
  """scikit-build-core's hooks, imported on first use (the choice above is
  testable without it)."""
  from scikit_build_core import build  # noqa: PLC0415

  return build


def _say(cuda: str) -> None:
  if cuda == "none":
    print("jax-comm-gemm: CPU-only build (jcg.cuda=none): no cuBLASMp extension, "
          "the XLA path only", file=sys.stderr)
  else:
    print(f"jax-comm-gemm: building the cuBLASMp extension against CUDA {cuda} "
          f"(-C jcg.cuda=none for a CPU-only package)", file=sys.stderr)


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
  cuda = cuda_choice(config_settings)
  _say(cuda)
  return [*_skbuild().get_requires_for_build_wheel(_skbuild_settings(config_settings)),
          *build_requirements(cuda)]


def get_requires_for_build_editable(config_settings: dict | None = None) -> list[str]:
  cuda = cuda_choice(config_settings)
  _say(cuda)
  return [*_skbuild().get_requires_for_build_editable(_skbuild_settings(config_settings)),
          *build_requirements(cuda)]


def get_requires_for_build_sdist(config_settings: dict | None = None) -> list[str]:
  return _skbuild().get_requires_for_build_sdist(_skbuild_settings(config_settings))


def build_wheel(wheel_directory: str, config_settings: dict | None = None,
                metadata_directory: str | None = None) -> str:
  return _skbuild().build_wheel(wheel_directory, _skbuild_settings(config_settings),
                              metadata_directory)


def build_editable(wheel_directory: str, config_settings: dict | None = None,
                   metadata_directory: str | None = None) -> str:
  return _skbuild().build_editable(wheel_directory, _skbuild_settings(config_settings),
                                 metadata_directory)


def build_sdist(sdist_directory: str, config_settings: dict | None = None) -> str:
  return _skbuild().build_sdist(sdist_directory, _skbuild_settings(config_settings))


# The prepare_metadata hooks are left out: pip then takes the metadata from the
# built wheel, which for this package costs nothing extra.
