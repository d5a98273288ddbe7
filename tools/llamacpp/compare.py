"""Decode on the CPU side by side with llama.cpp, on the same checkpoint: fmoe-local per expert format against
llama.cpp per GGUF type, rounds interleaved, each against the memory limit measured in the same round.

Why a tool and not a `bench` command: llama.cpp is not a dependency of ours (users never compile anything), so the
comparison needs a llama.cpp source tree (its converter and gguf-py) and a llama-cpp-python build, both given here.

  python tools/llamacpp/compare.py --llama-src DIR --llama-python PY [--layers 2] [--rounds 3] [--tokens 32]
      [--work-dir W] [--formats bf16,int8,int4] [--types bf16,q8_0,q4_0,q4_k_m]

- The checkpoint is `bench cpu-decode`'s (fmoe_bench/cpu_decode.py `checkpoint`: Qwen3-30B-A3B widths, random bf16
  weights, seed 0), kept in --work-dir, converted once with llama.cpp's own convert_hf_to_gguf.py to bf16 GGUF
  (its byte-level test tokenizer has no known pre-tokenizer hash, so the converter is told "default": the
  tokenizer does not matter to a decode timing) and quantised once per type with llama.cpp's own quantiser.
- Each round runs `bench cpu-decode --rounds 1 --threads T` (T: --threads, llama.cpp's too; its table: tok/s, the
  DRAM bandwidth it measured at the round's start, each format's share of its limit against the bytes a token
  reads with every weight at its stored size: with int8/int4 experts, dense format auto packs the attention and the
  output head the same way, as llama.cpp's q8_0/q4_0 files do), then llama.cpp on every type
  (tools/llamacpp/time_gguf.py in --llama-python: `Llama.eval` of one token at a time after a warm-up, as many
  tokens), the order of the two reversed every other round. llama.cpp's limit uses the same round's bandwidth and
  the bytes a token reads in that file (gguf-py's reader: every tensor but the token embedding, of which one row,
  with the expert tensors at K/J).
Prints one table: per round and format/type, tok/s and share of the limit; then the medians and the ratio of ours
to llama.cpp for each pair (bf16/bf16, int8/q8_0, int4/q4_0 and q4_k_m).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TIME_GGUF = Path(__file__).with_name("time_gguf.py")  # llama.cpp's side, run in --llama-python
PAIRS = (("bf16", "bf16"), ("int8", "q8_0"), ("int4", "q4_0"), ("int4", "q4_k_m"), ("nf4", "q4_0"))
CONVERT = """
import sys
sys.argv = sys.argv[1:]
sys.path.insert(0, {src!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # a test tokenizer: no known hash
exec(compile(open({script!r}).read(), {script!r}, "exec"), {{"__name__": "__main__", "__file__": {script!r}}})
"""


def gguf_files(src: Path, py: str, model_dir: Path, work: Path, types: list[str]) -> dict[str, Path]:
    """{type: GGUF file} converted and quantised once (kept in `work`)."""
    out = {t: work / f"model-{t}.gguf" for t in types}
    base = out.get("bf16", work / "model-bf16.gguf")
    if not base.exists():
        script = str(src / "convert_hf_to_gguf.py")
        code = CONVERT.format(src=str(src), script=script)
        cmd = [sys.executable, "-c", code, script, str(model_dir), "--outtype", "bf16", "--outfile", str(base)]
        subprocess.run(cmd, check=True, env=_gguf_env(src))
    for t, path in out.items():
        if t != "bf16" and not path.exists():
            cmd = [py, str(TIME_GGUF), "quantize", str(base), str(path), t]
            subprocess.run(cmd, check=True, env=_gguf_env(src))
    return out


def ours(
    model_dir_root: Path, layers: int, formats: str, tokens: int, threads: int, int8_product: str = "auto"
) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "fmoe_bench.cli", "cpu-decode", "--layers", str(layers), "--rounds", "1"]
        cmd += ["--tokens", str(tokens), "--formats", formats, "--work-dir", str(model_dir_root), "--json", f.name]
        cmd += ["--threads", str(threads)]  # as many as llama.cpp gets: torch's own choice may differ
        cmd += ["--dense-int8-product", int8_product]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def theirs(src: Path, py: str, files: dict[str, Path], tokens: int, threads: int) -> dict[str, dict]:
    cmd = [py, str(TIME_GGUF), "time", "--tokens", str(tokens), "--threads"]
    cmd += [str(threads), *[f"{t}={p}" for t, p in files.items()]]
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=_gguf_env(src))
    return json.loads(done.stdout)


def _gguf_env(src: Path) -> dict[str, str]:
    """llama.cpp's own gguf-py (the reader and the quantiser's file format) from the source tree."""
    return os.environ | {"PYTHONPATH": str(src / "gguf-py")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", type=Path, required=True, help="a llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "fmoe-llamacpp")
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--types", default="bf16,q8_0,q4_0,q4_k_m")
    ap.add_argument("--dense-int8-product", default="auto", help="ours: what multiplies dense int8 (cpu-decode's)")
    args = ap.parse_args()

    from fmoe_bench.cpu_decode import checkpoint

    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoint(args.work_dir, "qwen3-30b-a3b", args.layers, print)
    files = gguf_files(args.llama_src, args.llama_python, model_dir, args.work_dir, args.types.split(","))
    rows: list[tuple[int, str, str, float, float]] = []  # round, runner, format, tok/s, share of the limit
    for r in range(args.rounds):
        gbps, llama = None, {}
        for step in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            if step == "ours":
                got = ours(args.work_dir, args.layers, args.formats, args.tokens, args.threads, args.dense_int8_product)
                gbps = got["info"]["dram_gbps"][0]  # measured at the start of cpu-decode's one round
                rows += [(r, "fmoe-local", row["fmt"], row["tok_s"], row["of_limit"]) for row in got["rows"]]
            else:
                llama = theirs(args.llama_src, args.llama_python, files, args.tokens, args.threads)
        for t, m in llama.items():  # the limit with this round's bandwidth and that file's bytes per token
            rows.append((r, "llama.cpp", t, m["tok_s"], m["tok_s"] * m["bytes"] / (gbps * 1e9)))
        print(f"round {r + 1}: DRAM {gbps:.1f} GB/s", flush=True)
    print(f"\n{'round':>5}  {'runner':10}  {'format':8}  {'tok/s':>7}  {'of limit':>8}")
    for r, who, fmt, toks, share in rows:
        print(f"{r + 1:>5}  {who:10}  {fmt:8}  {toks:7.2f}  {share:8.0%}")
    med = {}
    for who in ("fmoe-local", "llama.cpp"):
        for fmt in {row[2] for row in rows if row[1] == who}:
            sel = [row for row in rows if row[1] == who and row[2] == fmt]
            med[who, fmt] = (statistics.median(s[3] for s in sel), statistics.median(s[4] for s in sel))
    print(f"\nmedians over {args.rounds} rounds; ratio = our tok/s ÷ llama.cpp's")
    print(f"{'ours':6} {'tok/s':>7} {'limit':>6}   {'llama.cpp':9} {'tok/s':>7} {'limit':>6}   {'ratio':>5}")
    for a, b in PAIRS:
        if ("fmoe-local", a) in med and ("llama.cpp", b) in med:
            (ta, sa), (tb, sb) = med["fmoe-local", a], med["llama.cpp", b]
            print(f"{a:6} {ta:7.2f} {sa:6.0%}   {b:9} {tb:7.2f} {sb:6.0%}   {ta / tb:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
