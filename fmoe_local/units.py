"""Sizes in the sentences and tables people read: one unit per quantity in a view, plain numbers (never 1.94e+04).

Two bases, both written GB, MB and KB as the app always has: DECIMAL for what file managers and the Hub measure
(downloads, disk, RAM), BINARY for the expert cache and what moves through it, which RuntimeConfig.cache_gb counts in
GiB (the cache field's "1 GB" is 1024³ bytes). A view picks its unit once, from the largest or the defining figure it
shows (`unit_for`), and writes every figure of that quantity in it (`size`), so that "589.8 KB" never stands beside
"0.562 MB". It does NOT decide which base a figure belongs to: the caller does, by the quantity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    name: str
    bytes: int


DECIMAL = (Unit("GB", 1000**3), Unit("MB", 1000**2), Unit("KB", 1000))
BINARY = (Unit("GB", 1024**3), Unit("MB", 1024**2), Unit("KB", 1024))


def unit_for(n_bytes: float, base: tuple[Unit, ...] = DECIMAL) -> Unit:
    """The largest unit of `base` in which `n_bytes` is at least 1 (the smallest for less, 0 included)."""
    return next((u for u in base if n_bytes >= u.bytes), base[-1])


def number(x: float, decimals: int | None = None, toward: str = "nearest") -> str:
    """`x` in fixed point, never with an exponent: `decimals` places (a table's column), or by default three
    significant digits without trailing zeros ("27", "13.8", "0.562") and whole numbers with thousands separators
    from 1000 up ("19,428"). `toward` "up" or "down": a minimum or maximum a user may type back stays within it
    (0.5625 → "0.563" up, "0.562" down)."""
    if not math.isfinite(x):
        raise ValueError(f"{x} is not a size")
    ax = abs(x)
    places = decimals
    if places is None:
        places = 0 if ax >= 1000 or ax == 0 else min(9, max(0, 2 - math.floor(math.log10(ax))))
    if toward != "nearest":
        step = math.ceil if toward == "up" else math.floor
        x = step(round(x * 10**places, 6)) / 10**places
    text = f"{x:,.{places}f}"
    return text.rstrip("0").rstrip(".") if decimals is None and "." in text else text


def size(n_bytes: float, unit: Unit, decimals: int | None = None, toward: str = "nearest") -> str:
    """`n_bytes` written in `unit`: "27 MB", "0.562 MB", "19,428 MB" ("27.0 MB" with decimals=1)."""
    return f"{number(n_bytes / unit.bytes, decimals, toward)} {unit.name}"


def size_auto(n_bytes: float, base: tuple[Unit, ...] = DECIMAL, decimals: int | None = None) -> str:
    """A figure that stands alone in its view, in the unit that fits it."""
    return size(n_bytes, unit_for(n_bytes, base), decimals)


def in_one_unit(*figures: float, base: tuple[Unit, ...] = DECIMAL, decimals: int | None = None) -> list[str]:
    """The figures of one sentence or list, all in the unit of the largest: ["6.0 GB", "0.5 GB"], not "500 MB"."""
    unit = unit_for(max(figures, default=0), base)
    return [size(n, unit, decimals) for n in figures]
