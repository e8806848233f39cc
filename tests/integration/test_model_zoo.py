"""The model zoo (tests/zoo.py): every causal-LM family of the installed transformers, tiny, through
our path; each family's row must be the one docs/models.md shows (regenerate it with `make
models-doc` after a change that moves a row)."""

from __future__ import annotations

import re
import warnings

import pytest
import transformers

from helpers import REPO
from zoo import check_family, families

DOC = (REPO / "docs" / "models.md").read_text()
ROWS = {line.split(" | ")[0].removeprefix("| "): line for line in DOC.splitlines() if line.startswith("| ")}
GENERATED_WITH = re.search(r"generated with transformers (\S+) ", DOC).group(1)


@pytest.mark.parametrize("family", families())
def test_family_row(family, tmp_path):
    if transformers.__version__ != GENERATED_WITH:
        pytest.skip(f"docs/models.md was generated with transformers {GENERATED_WITH}, this is "
                    f"{transformers.__version__}: `make models-doc` regenerates it")
    warnings.filterwarnings("ignore")
    assert check_family(family, tmp_path).markdown() == ROWS.get(family), "make models-doc regenerates docs/models.md"


def test_every_decoder_family_of_this_year_trains():
    """The families people fine-tune at the end of 2026 train through our path (their rows say so)."""
    for family in ("qwen3", "qwen3_5_text", "qwen3_5 (vision-language)", "qwen3_5_moe (vision-language)",
                   "qwen3_moe", "qwen3_next", "gemma3_text", "gemma3 (vision-language)", "llama", "llama4_text",
                   "mistral3 (vision-language)", "deepseek_v3", "glm4_moe", "minimax_m2", "gpt_oss", "olmo3",
                   "olmo_hybrid", "mixtral", "phi3", "granite", "cohere2", "gemma2"):
        assert ROWS[family].endswith("| trains, exports |"), ROWS[family]
