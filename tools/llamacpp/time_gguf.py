"""llama.cpp's side of tools/llamacpp/compare.py, run in a Python that has llama-cpp-python (and its gguf-py).

  python time_gguf.py quantize IN.gguf OUT.gguf TYPE        # llama.cpp's own quantiser (q8_0, q4_0, q4_k_m, ...)
  python time_gguf.py time --tokens N --threads T TYPE=FILE ...   # JSON {TYPE: {tok_s, bytes}} on stdout

`time` loads each file, evaluates two tokens to warm up, then N tokens one at a time (`Llama.eval`, one decode step
each, as fmoe-local's decode), and reports N ÷ the time. `bytes` is what one token reads in that file: every tensor
but the token embedding (one row of it), the routed-expert tensors (`*_exps`) at K/J of their size.
"""

from __future__ import annotations

import json
import sys
import time


def quantize(src: str, dst: str, kind: str) -> None:
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantise {src} to {kind}")


def token_bytes(path: str) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {f.name: f for f in reader.fields.values()}
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    experts = int(fields[f"{arch}.expert_count"].parts[-1][0])
    used = int(fields[f"{arch}.expert_used_count"].parts[-1][0])
    total = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            total += n // int(t.shape[-1])  # one row (gguf shapes are innermost first)
        elif "_exps" in t.name:
            total += n * used // experts
        else:
            total += n
    return total


def time_file(path: str, tokens: int, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=tokens + 16, n_batch=8, n_threads=threads, verbose=False)
    llm.eval([1, 2])
    t0 = time.perf_counter()
    for i in range(tokens):
        llm.eval([3 + i % 100])
    elapsed = time.perf_counter() - t0
    llm.close()
    return tokens / elapsed


def main(argv: list[str]) -> int:
    if argv[0] == "quantize":
        quantize(*argv[1:4])
        return 0
    tokens = int(argv[argv.index("--tokens") + 1])
    threads = int(argv[argv.index("--threads") + 1])
    out = {}
    for item in (a for a in argv[1:] if "=" in a):
        kind, path = item.split("=", 1)
        out[kind] = {"tok_s": time_file(path, tokens, threads), "bytes": token_bytes(path)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
