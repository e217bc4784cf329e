"""A profile: the image it expects (package versions and commits) and its fixes, in order.

Profiles are data (`profiles/<name>.toml`), one per release. A stand-in profile may `extends`
another and override single fields (e.g. the expected commit of a public stand-in tree).

A layered profile names a `base` profile: its fixes run after all of the base's, in the same
plan (so it can never be applied without them), and it keeps its own `stamp` file next to the
base's, both rewritten by its runs (the port's runner patches on top of the v0.30.0 profile).
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from fixes.unit import FixUnit, UnitError, load_unit, missing_unit

FIXES_DIR = Path(__file__).resolve().parent
PROFILES_DIR = FIXES_DIR / "profiles"
DEFAULT_STAMP = ".beam-hpu-fixes.json"


class ProfileError(Exception):
    pass


@dataclass(frozen=True)
class PackageSpec:
    module: str  # top-level import name, e.g. "vllm_gaudi"
    distributions: tuple[str, ...]
    commit: str
    version: str | None  # None: the release does not pin a version string
    known_builds: dict[str, str]  # "dist==version" -> commit, for builds that record none


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    packages: dict[str, PackageSpec]
    fixes: tuple[FixUnit, ...]  # a layered profile's: the base's, then its own
    stamp: str = DEFAULT_STAMP  # file name of the stamp in each package directory
    base: "Profile | None" = None

    def chain(self) -> list["Profile"]:
        """This profile and its bases, innermost last."""
        return [self] + (self.base.chain() if self.base else [])


def available_profiles(profiles_dir: Path = PROFILES_DIR) -> list[str]:
    return sorted(p.stem for p in profiles_dir.glob("*.toml"))


def load_profile(name: str, profiles_dir: Path = PROFILES_DIR) -> Profile:
    data = _read_merged(name, profiles_dir, seen=())
    try:
        packages = {m: _package(m, spec) for m, spec in data["packages"].items()}
        names = list(data["fixes"])
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"profile {name}: missing or malformed {exc}") from exc
    if len(set(names)) != len(names):
        raise ProfileError(f"profile {name}: a fix is listed twice")
    base = load_profile(data["base"], profiles_dir) if data.get("base") else None
    stamp = data.get("stamp", DEFAULT_STAMP)
    if base is not None:
        if base.packages != packages:
            raise ProfileError(f"profile {name}: its packages differ from its base {base.name}'s")
        if any(p.stamp == stamp for p in base.chain()):
            raise ProfileError(f"profile {name}: stamp {stamp} is also its base's")
        if set(names) & {u.name for u in base.fixes}:
            raise ProfileError(f"profile {name}: a fix is also in its base {base.name}")
    units_dir = (FIXES_DIR / data.get("units_dir", "units")).resolve()
    units = list(base.fixes) if base else []
    for fix in names:
        path = unit_path(units_dir, fix, name)
        if not path.is_file():  # listed but not written yet: every run refuses it, by name
            units.append(missing_unit(fix, path))
            continue
        try:
            unit = load_unit(path)
        except UnitError as exc:
            raise ProfileError(f"profile {name}: {exc}") from exc
        if unit.package not in packages:
            raise ProfileError(f"profile {name}: fix {fix} targets {unit.package}, not in [packages]")
        units.append(unit)
    return Profile(name, data.get("description", "").strip(), packages, tuple(units), stamp, base)


def unit_path(units_dir: Path, fix: str, profile: str) -> Path:
    """`<fix>.toml` anywhere below `units_dir` (the port keeps each unit in its feature's room), or
    the path it would have at the top when there is none."""
    found = sorted(units_dir.rglob(f"{fix}.toml"))
    if len(found) > 1:
        raise ProfileError(f"profile {profile}: fix {fix} has {len(found)} unit files: "
                           f"{', '.join(str(p) for p in found)}")
    return found[0] if found else units_dir / f"{fix}.toml"


def _read_merged(name: str, profiles_dir: Path, seen: tuple[str, ...]) -> dict:
    if name in seen:
        raise ProfileError(f"profile {name}: extends itself through {' -> '.join(seen)}")
    path = profiles_dir / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(available_profiles(profiles_dir)) or "none"
        raise ProfileError(f"no profile {name!r} in {profiles_dir} (known: {known})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    base = data.pop("extends", None)
    if base is None:
        return data
    return _merge(_read_merged(base, profiles_dir, seen + (name,)), data)


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged


def _package(module: str, spec: dict) -> PackageSpec:
    commit = str(spec["commit"]).lower().removeprefix("g")
    if len(commit) < 7 or any(c not in "0123456789abcdef" for c in commit):
        raise ProfileError(f"package {module}: commit {spec['commit']!r} is not a 7+ digit hex id")
    return PackageSpec(
        module=module,
        distributions=tuple(spec["distributions"]),
        commit=commit,
        version=spec.get("version"),
        known_builds=dict(spec.get("known_builds", {})),
    )
