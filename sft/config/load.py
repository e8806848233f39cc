"""Loading the config: YAML, then dotted command-line overrides, each value converted to its field's
type (or a problem naming the key), then validated (sft/config/checks.py)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from sft.config.checks import ConfigError, range_checks
from sft.config.schema import Config


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` converted to `annotation`, or raise TypeError saying what was expected."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except TypeError as e:
                errors.append(str(e))
        raise TypeError(" or ".join(errors) + (" or null" if type(None) in args else ""))
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise TypeError(f"one of {list(choices)}")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise TypeError("a mapping of names to values")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise TypeError("a list")
        return [_coerce(v, typing.get_args(annotation)[0], key) for v in value]
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise TypeError(f"a list of {len(args)} values")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if annotation is bool:
        if not isinstance(value, bool):
            raise TypeError("true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("an integer")
        return value
    if annotation is float:
        # YAML 1.1 reads `1e-5` as a string; accept any number written in Python syntax.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise TypeError("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError("a finite number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise TypeError("a string")
        return value
    raise AssertionError(f"unsupported config annotation {annotation!r} for {key}")


# Keys of earlier versions that nothing reads any more, and why: a run's saved config.yaml that holds
# one still loads (its checkpoints export and resume); a config file that sets one is told to drop it.
RETIRED = {"moe.router_fp32": "routers compute as the model's own code does (sft/models/moe.py)"}


def _build_section(cls: type, values: dict, prefix: str, problems: list[str], saved: bool = False) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if dotted in RETIRED:
            if not saved:
                problems.append(f"{dotted}: retired ({RETIRED[dotted]}); remove it")
            continue
        if key not in hints:
            problems.append(f"{dotted}: unknown key (valid keys{' in ' + prefix[:-1] if prefix else ''}: "
                            f"{', '.join(names)})")
            continue
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                keys = ", ".join(f.name for f in dataclasses.fields(annotation))
                problems.append(f"{dotted}: must be a mapping of keys ({keys})")
                continue
            kwargs[key] = _build_section(annotation, value, f"{dotted}.", problems, saved)
            continue
        try:
            kwargs[key] = _coerce(value, annotation, dotted)
        except TypeError as e:
            problems.append(f"{dotted}={value!r}: expected {e}")
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def load_config(path: str | Path | None, overrides: list[str] = (), local_checks: bool = True) -> Config:
    """Read YAML at `path` (may be None), apply `key.sub=value` overrides, validate, return Config.
    `local_checks=False`: do not require the files the config names (data, resume checkpoint) or the
    optional packages it asks for to exist here, for tools that only read the config (the planner,
    on a login node)."""
    source = str(path) if path else "<defaults>"
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {source} not found")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections (model:, data:, ...)")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write overrides as section.key=value (e.g. ac.ratio=0.5)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(f"{source}: override {item!r}: the value is not valid YAML ({problem}); write it as "
                              "YAML, e.g. 'data.chat_template_kwargs={enable_thinking: false}', quoted for the "
                              "shell") from None
        _set_dotted(tree, key.strip(), value)
    problems: list[str] = []
    cfg = _build_section(Config, tree, "", problems)
    if not problems:
        problems = range_checks(cfg, local_checks)
    if problems:
        where = source + (f" with overrides {list(overrides)}" if overrides else "")
        raise ConfigError(f"invalid config ({where}):\n  - " + "\n  - ".join(problems))
    return cfg


def read_resolved_config(path: Path) -> Config:
    """The config a run resolved and saved (a checkpoint's config.yaml), typed through the schema but
    not checked again: it was checked when the run started, and some checks hold only where it ran."""
    problems: list[str] = []
    cfg = _build_section(Config, yaml.safe_load(path.read_text()) or {}, "", problems, saved=True)
    if problems:
        raise ConfigError(f"{path} does not fit this version's config ({'; '.join(problems)})")
    return cfg


def to_yaml(cfg: Config) -> str:
    def plain(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items()}
        if isinstance(obj, tuple):
            return list(obj)
        return obj

    return yaml.safe_dump(plain(dataclasses.asdict(cfg)), sort_keys=False)


def parse_args(argv: list[str] | None = None) -> Config:
    """`--config path.yaml key.sub=value ...` -> validated Config."""
    parser = argparse.ArgumentParser(description="Full-parameter SFT with FSDP2.")
    parser.add_argument("--config", required=True, help="YAML file (see configs/ and `python -m sft.config`)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ac.ratio=0.5 optim.lr=2e-5")
    args = parser.parse_args(argv)
    return load_config(args.config, args.overrides)
