"""build_backend/jcg_build.py: which CUDA the build takes (-C jcg.cuda, else
JCG_CUDA, else 13), what the build environment gets for it, and what
scikit-build-core is told. The build itself is .ci/wheel-check's."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("jcg_build", ROOT / "build_backend" / "jcg_build.py")
jcg_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jcg_build)


@pytest.mark.parametrize("settings, environ, expected", [
    ({}, {}, "13"),
    (None, {"JCG_CUDA": "12"}, "12"),
    ({"jcg.cuda": "none"}, {"JCG_CUDA": "12"}, "none"),   # the setting wins
    ({"jcg.cuda": ["13", "12"]}, {}, "12"),                # pip passes repeats as a list
    ({"jcg.cuda": "cuda12"}, {}, "12"),
    ({"jcg.cuda": "CPU"}, {}, "none"),
])
def test_cuda_choice(settings, environ, expected):
  assert jcg_build.cuda_choice(settings, environ) == expected


@pytest.mark.parametrize("settings, environ, named", [
    ({"jcg.cuda": "11"}, {}, "-C jcg.cuda"),
    ({}, {"JCG_CUDA": "yes"}, "JCG_CUDA"),
])
def test_cuda_choice_refuses(settings, environ, named):
  with pytest.raises(ValueError, match=f"{named} must be one of 13, 12, none"):
    jcg_build.cuda_choice(settings, environ)


def test_requirements_come_from_the_extras():
  import tomllib
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  for cuda in ("13", "12"):
    requires = jcg_build.build_requirements(cuda)
    assert set(extras[f"cuda{cuda}"]) <= set(requires)
    assert any(r.startswith("nanobind") for r in requires)
    assert any(r.startswith("jax>=") for r in requires)   # its FFI headers
  assert jcg_build.build_requirements("none") == []


def test_settings_passed_on(monkeypatch):
  monkeypatch.delenv("JCG_CUDA", raising=False)
  settings = jcg_build._skbuild_settings({"jcg.cuda": "12", "build.verbose": "true"})
  assert settings == {"cmake.define.JCG_CUDA": "12", "build.verbose": "true"}
  assert jcg_build._skbuild_settings({"jcg.cuda": "none"}) == {"wheel.cmake": "false"}
  assert jcg_build._skbuild_settings(None) == {"cmake.define.JCG_CUDA": "13"}
