"""Every command line's numeric flags (app.py, run, bench …): impossible values are refused while parsing, in one line.

The attack run found `--port 99999` (OverflowError traceback), `--port 0` (served and recorded port 0),
`--temperature nan` (a torch traceback mid-request); these tests walk every parser so that a flag added later with a
bare `type=int` or `type=float` fails here instead of in the next attack run.
"""

from __future__ import annotations

import argparse
import math

import pytest

import app
from fmoe_bench import cli as bench_cli
from fmoe_local import cli, cli_args
from fmoe_local.config import RuntimeConfig, Sampling


def _parsers(parser: argparse.ArgumentParser, name: str = ""):
    yield name or parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}".strip())


def _every_option():
    for top in (app.build_parser(), cli.build_parser((bench_cli,))):
        for name, parser in _parsers(top):
            for action in parser._actions:
                if action.option_strings or action.dest not in ("help",):
                    yield name, parser, action


def _numeric(action: argparse.Action) -> bool:
    return getattr(action.type, "__name__", "") in ("whole number", "number", "port", "seed", "list of whole numbers")


def test_no_flag_takes_a_bare_int_or_float():
    """A bare int takes 0, -1 and 2**80; a bare float takes nan and inf: each must name its range (cli_args.py)."""
    bare = [f"{name} {a.option_strings or a.dest}" for name, _, a in _every_option() if a.type in (int, float)]
    assert bare == []


def test_every_numeric_flag_refuses_nan_infinity_negatives_and_words():
    checked, taken = 0, []
    for name, _, action in _every_option():
        if not (_numeric(action) or action.type is cli.distance_arg):
            continue
        for text in ("nan", "inf", "-inf", "-1", "ten", ""):
            try:
                action.type(text)
            except argparse.ArgumentTypeError:
                continue
            taken.append(f"{name} {action.option_strings} {text!r}")
        checked += 1
    assert taken == []
    assert checked >= 40  # run, app and every bench command's counts and sizes


def test_every_parser_refuses_in_one_line_with_exit_code_2(capsys):
    for top in (app.build_parser(), cli.build_parser((bench_cli,))):
        for _, parser in _parsers(top):
            assert isinstance(parser, cli_args.SentenceParser), parser.prog
    with pytest.raises(SystemExit) as refused:
        cli.build_parser((bench_cli,)).parse_args(["bench", "cpu-experts", "--tokens", "0,16"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1
    assert err == (
        "fmoe-local bench cpu-experts: Argument --tokens: give whole numbers of at least 1 separated by commas, "
        "e.g. 1,16 (got '0,16'). See `fmoe-local bench cpu-experts --help`.\n"
    )


def test_ranges_take_their_ends_and_refuse_past_them():
    assert cli_args.port("1") == 1 and cli_args.port("65535") == 65535
    for text in ("0", "65536", "-1", "99999"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"from 1 to 65535"):
            cli_args.port(text)
    fraction = cli_args.number(above=0, most=1)
    assert fraction("1") == 1.0 and fraction("0.25") == 0.25
    with pytest.raises(argparse.ArgumentTypeError, match=r"above 0 and at most 1 \(got 0\)"):
        fraction("0")
    assert cli_args.seed(str(2**64 - 1)) == 2**64 - 1
    with pytest.raises(argparse.ArgumentTypeError):
        cli_args.seed(str(2**64))


@pytest.mark.parametrize(
    "config",
    [
        RuntimeConfig(cache_gb=math.nan),
        RuntimeConfig(cache_gb=math.inf),
        RuntimeConfig(host_ram_gb=math.nan),
        RuntimeConfig(pinned_ram_gb=math.inf),
        RuntimeConfig(load_timeout_s=math.inf),
        RuntimeConfig(sampling=Sampling(temperature=math.nan)),
        RuntimeConfig(sampling=Sampling(temperature=-1.0)),
        RuntimeConfig(sampling=Sampling(top_p=math.nan)),
        RuntimeConfig(sampling=Sampling(max_new_tokens=0)),
        RuntimeConfig(sampling=Sampling(seed=2**80)),
    ],
)
def test_the_library_refuses_the_same_values_with_a_sentence(config):
    """Runtime.load validates its config: a program using fmoe_local without the command line is refused too
    (before: NaN passed every `<= 0` test, and infinity overflowed `int(cache_gb * GiB)` as a traceback)."""
    with pytest.raises(ValueError, match=r"^(Set|Temperature|Top-p|Max new tokens|The seed|The expert cache) "):
        config.validate()
