"""Experiment configs: one YAML per experiment, installed as package data, plus overrides.

`load_config("tiny")` reads magicube/configs/tiny.yaml; a path reads that file. Overrides are
`dotted.key=value` strings, the value parsed as YAML (`train.steps=20`, `model.attention=sparse`).
"""
from __future__ import annotations

import copy
import math
from importlib import resources
from pathlib import Path

import yaml

from magicube.train.files import write_atomic


def config_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("magicube.configs").iterdir() if p.name.endswith(".yaml"))


def load_config(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():  # a folder named like a config (a run) is not one
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} not found")
        text = path.read_text()
    else:
        res = resources.files("magicube.configs") / f"{name_or_path}.yaml"
        if not res.is_file():
            raise FileNotFoundError(f"no config named {name_or_path!r}; built-in configs: {', '.join(config_names())}, "
                                    "or pass a path to a YAML file")
        text = res.read_text()
    cfg = yaml.safe_load(text) or {}
    return apply_overrides(cfg, overrides)


def apply_overrides(cfg: dict, overrides) -> dict:
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected dotted.key=value")
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
            node = node[p]
        node[leaf] = yaml.safe_load(value)
    return cfg


def check_count(name: str, value, least: int, optional: bool = False) -> int | None:
    """A setting that counts something (steps, a batch, examples, a model's layers): an integer of at
    least `least`, refused by its dotted name otherwise (a bool is not a count); null too if optional."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an integer >= {least}{' or null' * optional}, got {value!r}")
    return value


def check_flag(name: str, value) -> bool:
    """A true/false setting (YAML's `yes` and `no` are booleans too; a string such as 'maybe' is not)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return value


def check_real(name: str, value, least: float | None = None, above: float | None = None,
               below: float | None = None, optional: bool = False) -> float | None:
    """A real setting (a learning rate, a norm, minutes) as a float within its bounds, refused by its
    dotted name otherwise; null too if optional. YAML 1.1 reads `1e-3` (no dot) as a string, so a
    string that spells a number is one."""
    if optional and value is None:
        return None
    bounds = [f">= {least}"] * (least is not None) + [f"> {above}"] * (above is not None) + \
        [f"< {below}"] * (below is not None)
    expected = f"{name}: expected a real number {' and '.join(bounds)}{' or null' * optional}, got {value!r}"
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        raise ValueError(expected) from None
    if not (math.isfinite(x) and (least is None or x >= least) and (above is None or x > above)
            and (below is None or x < below)):
        raise ValueError(expected)
    return x


def dump_config(cfg: dict, path: str | Path) -> None:
    write_atomic(path, yaml.safe_dump(cfg, sort_keys=False))
