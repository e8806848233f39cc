"""python -m sft.config                                   the config reference (markdown)
python -m sft.config --help                              this text
python -m sft.config --readme docs/configuration.md      refresh the reference there
python -m sft.config CONFIG [overrides]                  the resolved config, validated
python -m sft.config --run-dir CONFIG [overrides]        the run directory (slurm/train.slurm)"""

from __future__ import annotations

import sys
from pathlib import Path

from sft.config.load import load_config, to_yaml
from sft.config.reference import reference_markdown, update_readme
from sft.errors import run_command


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
    elif args[:1] == ["--readme"]:
        update_readme(Path(args[1]))
    elif args[:1] == ["--run-dir"]:
        print(load_config(args[1], args[2:]).run_dir)
    elif args:
        print(to_yaml(load_config(args[0], args[1:])), end="")
    else:
        print(reference_markdown(), end="")


if __name__ == "__main__":
    run_command(main)
