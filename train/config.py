"""Experiment configs: one YAML per experiment, installed as package data, plus overrides.

`load_config("tiny")` reads magicube/configs/tiny.yaml; a path reads that file. Overrides are
`dotted.key=value` strings, the value parsed as YAML (`train.steps=20`, `model.attention=sparse`).
"""
from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

import yaml


def config_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("magicube.configs").iterdir() if p.name.endswith(".yaml"))


def load_config(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
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


def check_count(name: str, value, least: int) -> int:
    """A setting that counts something (steps, a batch, examples, a model's layers): an integer of at
    least `least`, refused by its dotted name otherwise (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
    return value


def dump_config(cfg: dict, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg, sort_keys=False))
