"""Compiled kernels kept across processes, so that a relaunch compiles nothing it compiled before.

torch.compile's graphs (inductor's FX graph and AOTAutograd caches), Triton's kernels and its
autotuning results (fla's Gated DeltaNet kernels autotune at their first call) and tilelang's
kernels are written under one folder, `compile.cache_dir` (by default ~/.cache/sft/compile): a
Slurm requeue, the next launch of a run and every later run of the same shapes load them from there
instead of compiling again (Qwen3.5-9B's first step: 117-190 s cold, 11-22 s warm; docs/BENCHMARKS.md).
torch's own default, /tmp/torchinductor_<user>, is lost with a job's node-local /tmp. One folder on a
filesystem the nodes share serves every rank and job: Triton's kernels and inductor's graphs are
written under a temporary name and renamed. Inductor's C++ libraries (compiled CPU runs) are written
in place: a run killed while compiling one can leave it truncated ("file too short" at every later
compile); deleting the folder's inductor/ fixes that. What dynamo traces is not cached: a warm
launch still traces each graph once.
"""

from __future__ import annotations

import os
from pathlib import Path

from sft.errors import UserError

# The variable each compiler reads its cache folder from, and the subfolder it gets there.
CACHE_FOLDERS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "TILELANG_CACHE_DIR": "tilelang"}
DEFAULT_CACHE_DIR = "~/.cache/sft/compile"


def use_compile_cache(cache_dir: str | None) -> str:
    """Before anything compiles or imports tilelang: every compiler's cache in its subfolder of
    `cache_dir` (compile.cache_dir); unset, a cache the environment already places stays there and
    the others go under DEFAULT_CACHE_DIR. Triton keeps its autotuning results on disk too. Returns
    where the caches are, for the log; a folder that cannot be made is one error naming the key."""
    root = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser().absolute()
    for variable, folder in CACHE_FOLDERS.items():
        if cache_dir is not None or variable not in os.environ:
            os.environ[variable] = str(root / folder)
        try:
            Path(os.environ[variable]).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"compile.cache_dir={cache_dir!r}: cannot make {os.environ[variable]} ({e.strerror}); set "
                            "compile.cache_dir to a writable folder (one the nodes share serves them all)") from None
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    _checkpointed_blocks_cacheable()
    places = [os.environ[variable] for variable in CACHE_FOLDERS]
    return "compile caches: " + (str(root) if places == [str(root / f) for f in CACHE_FOLDERS.values()]
                                 else ", ".join(places))


def _checkpointed_blocks_cacheable() -> None:
    """A checkpointed block replays its random ops in backward (SDPA's GPU kernels count as one,
    dropout 0 or not); torch < 2.13 replays them through a higher-order op its FX graph cache
    refuses (graphsafe_run_with_rng_state, pytorch#185562), so no checkpointed block was ever cached
    (measured: 4 of 4 graphs of P-7B LoRA with ac.ratio=1). The other replay (run_and_save_rng_state)
    is cacheable; the graph-safe one exists for CUDA graphs, which no run here captures."""
    import torch
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    if not graphsafe_run_with_rng_state.cacheable():
        torch._functorch.config.graphsafe_rng_functionalization = False


def compiled_graphs() -> dict[str, int]:
    """What torch.compile's inductor did in this process so far: graphs loaded from the cache,
    compiled (and written to it), and compiled without a cache entry (a graph inductor cannot cache)."""
    from torch._dynamo.utils import counters  # here: importing dynamo takes a second that most tools need not pay

    inductor = counters["inductor"]
    return {"from_cache": inductor["fxgraph_cache_hit"], "compiled": inductor["fxgraph_cache_miss"],
            "uncached": inductor["fxgraph_cache_bypass"]}
