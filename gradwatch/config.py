"""Config: resolves ``rules=`` (a name, Rule objects, a TOML file) and ``[tool.gradwatch]`` into settings.

Config is data: TOML is parsed, never evaluated, and every key is validated before training
starts, with errors that name the file, the rule and the field.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradwatch.errors import ConfigError
from gradwatch.rules import DEFAULT_RULES, Rule, parse

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PYPROJECT = "pyproject.toml"


@dataclass
class Config:
    """Resolved configuration.

    Attributes:
        rules: the rules, or None to detect and record only (training is never changed).
        options: watcher options set by the file (explicit keyword arguments override them).
        source: where the configuration came from (a file path, ``"default"`` or ``"python"``).
    """

    rules: list[Rule] | None
    options: dict[str, Any] = field(default_factory=dict)
    source: str = "default"

    def describe(self) -> Any:
        """The rules as plain data, for the run's metadata."""
        if self.rules is None:
            return None
        return {"source": self.source, "rules": [repr(r) for r in self.rules]}


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest pyproject.toml with a ``[tool.gradwatch]`` table, from ``start`` (cwd) upwards."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / PYPROJECT
        if candidate.is_file():
            data = _read(candidate)
            if isinstance(data.get("tool"), Mapping) and "gradwatch" in data["tool"]:
                return candidate
            return None  # the project's own pyproject.toml says nothing about gradwatch
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        # utf-8-sig: a byte order mark at the start (as some Windows editors write) is not TOML's business
        return tomllib.loads(path.read_bytes().decode("utf-8-sig"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: nested too deeply") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None


def load(path: str | Path) -> Config:
    """Read a standalone rules file, or the ``[tool.gradwatch]`` table of a pyproject.toml."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} not found; rules= takes 'default', None, a list of gw.Rule, "
            "or the path of a TOML file"
        )
    data = _read(path)
    where = str(path)
    if path.name == PYPROJECT:
        tool = data.get("tool", {})
        if not isinstance(tool, Mapping) or "gradwatch" not in tool:
            raise ConfigError(f"{path}: no [tool.gradwatch] table")
        data, where = tool["gradwatch"], f"{path} [tool.gradwatch]"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a table")
    return from_table(data, where)


def from_table(data: Mapping[str, Any], where: str) -> Config:
    """Settings and rules from a parsed table (the top level of a rules file)."""
    options = {k: v for k, v in data.items() if k != "rules"}
    for forbidden in ("run",):
        if forbidden in options:
            raise ConfigError(f"{where}: {forbidden!r} cannot be set in a config file; pass it to gw.watch")
    raw = data.get("rules")
    if raw is None:
        rules = list(DEFAULT_RULES)
    elif raw == "default":
        rules = list(DEFAULT_RULES)
    elif raw == "none":
        return Config(None, options, where)
    else:
        rules = parse(raw, where)
    return Config(rules, options, where)


def resolve(rules: Any) -> Config:
    """Turn the ``rules=`` argument of ``gw.watch`` into a Config.

    ``"default"`` uses ``[tool.gradwatch]`` from the nearest pyproject.toml when there is one,
    else the built-in default rules; None records only; a path reads a TOML file; a Rule or a
    list of Rule objects / rule tables is used as given.
    """
    if rules is None:
        return Config(None, source="none")
    if isinstance(rules, str) and rules == "default":
        found = find_pyproject()
        return load(found) if found is not None else Config(list(DEFAULT_RULES))
    if isinstance(rules, Rule):
        return Config([rules], source="python")
    if isinstance(rules, (str, Path)):
        return load(rules)
    if isinstance(rules, (list, tuple)):
        return Config(parse(list(rules), "rules"), source="python")
    raise ConfigError(
        f"rules={rules!r} is not valid; use 'default', None, a gw.Rule or a list of them, or the path of a TOML file"
    )
