"""Argument types shared by every command line (app.py, `run`, `bench …`), and the parser that prints their refusals.

Scope: turning one flag's text into a value or refusing it. It does NOT check values against a model (cli.py does,
once the model's config is read) nor hold any default (config.py does).

Why here: argparse's `type=int` takes 0, -1 and 99999 for a port, and `type=float` takes "nan" and "inf", which
then fail deep inside torch or a socket call as a traceback, or run silently wrong (DEVELOPERS.md: impossible values
are refused with a sentence, never clamped). Every numeric flag names its range once, here, and a value outside it
is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from fmoe_local.config import MAX_SEED

MAX_PORT = 65535


class SentenceParser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals are one line saying what was wrong and where help is, instead of the usage
    block (several lines that push the reason out of sight) followed by a terse "error:" line. Sub-parsers made
    with `add_subparsers().add_parser` are of this class too (argparse uses the parent's class)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        said = message[:1].upper() + message[1:]
        if not said.endswith((".", "?", "!")):
            said += "."
        self.exit(2, f"{self.prog}: {said} See `{self.prog} --help`.\n")


def _show(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_words(least: float | None, most: float | None, above: float | None = None) -> str:
    """' from 1 to 65535', ' above 0', ' of at least 1', or '' for an open range (leading space included)."""
    if above is not None:
        return f" above {_show(above)}" + (f" and at most {_show(most)}" if most is not None else "")
    if least is not None and most is not None:
        return f" from {_show(least)} to {_show(most)}"
    if least is not None:
        return f" of at least {_show(least)}"
    if most is not None:
        return f" of at most {_show(most)}"
    return ""


def whole(least: int | None = None, most: int | None = None) -> Callable[[str], int]:
    """A whole number within [least, most] (either end may be open)."""
    words = _range_words(least, most)

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"give a whole number{words} (got '{text}')") from None
        if (least is not None and value < least) or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"give a whole number{words} (got {value})")
        return value

    parse.__name__ = "whole number"
    return parse


def number(least: float | None = None, most: float | None = None, above: float | None = None) -> Callable[[str], float]:
    """A finite number within [least, most], or (above, most] when `above` is given. NaN and infinities are never
    a setting: NaN passes every `<` test and infinity overflows every conversion to a count."""
    if least is not None:
        least = float(least)
    if most is not None:
        most = float(most)
    words = _range_words(least, most, above)

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"give a number{words} (got '{text}')") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"give a finite number{words} (got '{text}')")
        if (
            (least is not None and value < least)
            or (above is not None and value <= above)
            or (most is not None and value > most)
        ):
            raise argparse.ArgumentTypeError(f"give a number{words} (got {text.strip()})")
        return value

    parse.__name__ = "number"
    return parse


def whole_list(least: int = 1) -> Callable[[str], list[int]]:
    """'1,16' → [1, 16] (sorted, each once), every one a whole number of at least `least`."""

    def parse(text: str) -> list[int]:
        try:
            values = sorted({int(p) for p in text.split(",") if p.strip()})
        except ValueError:
            values = []
        if not values or values[0] < least:
            raise argparse.ArgumentTypeError(
                f"give whole numbers of at least {least} separated by commas, e.g. 1,16 (got '{text}')"
            )
        return values

    parse.__name__ = "list of whole numbers"
    return parse


def some_text(text: str) -> str:
    """Text with something in it: an empty or all-blank value is a mistake (an unset shell variable), not a request."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give some text; it was empty")
    return text


port = whole(1, MAX_PORT)
port.__name__ = "port"
seed = whole(0, MAX_SEED)
seed.__name__ = "seed"
