"""compile.cache_dir: where each compiler's cache goes, what the environment already says, one error
for a folder that cannot be made, and checkpointed blocks made cacheable where torch cannot cache
their random-op replay. (A relaunch that compiles nothing: tests/integration/test_train.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from sft.compile_cache import CACHE_FOLDERS, use_compile_cache
from sft.errors import UserError


@pytest.fixture
def clean_environment(monkeypatch):
    """The variables use_compile_cache sets, unset now and restored after the test."""
    for variable in [*CACHE_FOLDERS, "TRITON_CACHE_AUTOTUNING"]:
        monkeypatch.delenv(variable, raising=False)
    with torch._functorch.config.patch(graphsafe_rng_functionalization=True):
        yield monkeypatch


def test_every_cache_goes_under_the_configured_folder(tmp_path, clean_environment):
    clean_environment.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))  # the config key wins over it
    assert use_compile_cache(str(tmp_path / "cache")) == f"compile caches: {tmp_path / 'cache'}"
    assert {variable: os.environ[variable] for variable in CACHE_FOLDERS} == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "triton"),
        "TILELANG_CACHE_DIR": str(tmp_path / "cache" / "tilelang")}
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1" and (tmp_path / "cache" / "triton").is_dir()


def test_unset_a_cache_the_environment_places_stays_there(tmp_path, clean_environment):
    clean_environment.setenv("HOME", str(tmp_path / "home"))
    clean_environment.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-of-the-cluster"))
    said = use_compile_cache(None)
    home = tmp_path / "home" / ".cache" / "sft" / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor-of-the-cluster")
    assert os.environ["TRITON_CACHE_DIR"] == str(home / "triton")
    assert said == f"compile caches: {tmp_path / 'inductor-of-the-cluster'}, {home / 'triton'}, {home / 'tilelang'}"


def test_a_folder_that_cannot_be_made_is_one_error_naming_the_key(tmp_path, clean_environment):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match=r"^compile\.cache_dir='.*a-file': cannot make .*; set compile\.cache_dir to a "
                                        r"writable folder"):
        use_compile_cache(str(tmp_path / "a-file"))


@pytest.mark.parametrize("cacheable", [True, False])
def test_checkpointed_blocks_replay_random_ops_in_a_way_the_cache_keeps(tmp_path, clean_environment, cacheable):
    """torch 2.11's FX graph cache refuses graphsafe_run_with_rng_state (every checkpointed block on a
    GPU: measured), torch 2.13's keeps it; the graph-safe replay is turned off only where refused."""
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    clean_environment.setattr(graphsafe_run_with_rng_state, "_cacheable", cacheable)
    use_compile_cache(str(tmp_path))
    assert torch._functorch.config.graphsafe_rng_functionalization is cacheable
