"""python -m sft.plan: see sft/plan/cli.py."""

from sft.errors import run_command
from sft.plan.cli import main

run_command(main)
