"""Where a prefill over a kept prefix spends its time: torch.profiler over the runtime's own steps, per op and shape.

`python tools/prefix_profile.py [--system-tokens 4000] [--passes 10]` loads the demo model (context raised as
`bench prefix` does) twice, keeping KV caches and not, prefills a system prompt once, then profiles `--passes`
requests that reuse it (PrefixCache.take, the request bracket with its semantic embedding over the reused tokens,
and the one forward pass of the first token) and as many fresh prompts of the same new tokens. It prints the time of
each (min and median, unprofiled) and each side's ops by self CPU time with their input shapes: the ops whose shapes
carry the prefix length (3961 for the default) are what reuse adds. The steps run on this thread while the runtime's
worker is idle (the profiler records the thread it is started on); their order is Runtime._run's.

`--decode N` instead times decoding: N greedy tokens (EOS banned) after the system prompt (prefilled whole) and after a short
prompt, ms per token (Runtime's tpot, medians of `--repeats`) and CPU ms per token (the same steps on this thread
with one torch thread, `time.thread_time`: less sensitive to other processes than the wall time), with nothing
profiled: what a KV cache that copies the whole context per token costs at a long context.

`--client N` instead times N pairs as an API client sees them (a chat under the system prompt: Runtime.check on this
thread, as the server checks a request, then submit until the first text event; the chat template rendered and the
conversation tokenized included, which the runtime's own TTFT leaves out), each followed at once by a fresh prompt of
the tokens it prefilled (their text, checked and submitted the same way) on the runtime that keeps nothing; min and
median of each side, and the runtime's TTFT of the same requests beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from fmoe_bench.prefix import new_part, system_prompt, with_context  # noqa: E402
from fmoe_local.config import RuntimeConfig, Sampling  # noqa: E402
from fmoe_local.demo import demo_model_dir  # noqa: E402
from fmoe_local.generate import generate_ids  # noqa: E402
from fmoe_local.runtime import Runtime  # noqa: E402
from fmoe_local.stats import RequestStats  # noqa: E402

SAMPLING = Sampling(greedy=True, max_new_tokens=1)


def first_token(runtime: Runtime, prompt: str, request_id: int) -> tuple[int, float]:
    """Runtime._run's steps up to the first token: how many tokens were reused and the ms it took."""
    e = runtime.engine
    ids = e.encode_prompt(prompt, None, None)
    prompt_list = ids[0].tolist()
    t0 = time.perf_counter()
    cache, reused = runtime._prefixes.take(prompt_list, 1)
    with e.request(request_id, RequestStats(), reused_ids=ids[:, :reused]):
        stop = threading.Event()
        tokens = generate_ids(e.model, ids, SAMPLING, e.eos_ids, stop, e.end_iteration, cache=cache, cached=reused)
        token = next(tokens)
    ms = 1000 * (time.perf_counter() - t0)
    runtime._prefixes.put(prompt_list + [token], cache)
    runtime._prefixes.prepare()  # as Runtime._run does after the request
    return reused, ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system-tokens", type=int, default=4000)
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--rows", type=int, default=20, help="ops shown per side")
    p.add_argument("--timing-only", action="store_true", help="the unprofiled times alone, no profile")
    p.add_argument("--decode", type=int, default=0, help="time N decode tokens instead (see above)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each decode timing, median taken")
    p.add_argument("--client", type=int, default=0, help="time N pairs as an API client sees them (see above)")
    args = p.parse_args()
    if args.decode:
        return decode(args)
    if args.client:
        return client(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = with_context(demo_model_dir(), Path(tmp) / "demo")
        config = RuntimeConfig(device="cpu")
        with Runtime.load(model, config) as reuse, Runtime.load(model, config.with_changes(prefix_cache_gb=0)) as whole:
            for r in (reuse, whole):
                r.generate("User: hello\nAssistant:", SAMPLING)
            system = system_prompt(reuse.engine.tokenizer, args.system_tokens)
            prompts = [
                f"System: {system}\nUser: question {i} about the tides?\nAssistant:" for i in range(3 * args.passes)
            ]
            reuse.generate(prompts[0], SAMPLING)
            second = reuse.generate(prompts[1], SAMPLING)
            fresh = new_part(reuse, prompts[1], second.stats.cached_tokens)  # the new tokens alone
            times: dict[str, list[float]] = {"reuse": [], "fresh": []}
            for i in range(2, args.passes + 2):  # unprofiled, interleaved
                reused, ms = first_token(reuse, prompts[i], i)
                times["reuse"].append(ms)
                times["fresh"].append(first_token(whole, fresh, 1000 + i)[1])
            n_fresh = len(whole.tokenize(fresh))
            print(f"reused {reused} tokens; new tokens {n_fresh}; torch threads {torch.get_num_threads()}")
            for name, ms in times.items():
                print(f"{name}: min {min(ms):.1f} ms, median {statistics.median(ms):.1f} ms")
            ratio = statistics.median(times["reuse"]) / statistics.median(times["fresh"])
            print(f"ratio of medians {ratio:.2f}, of mins {min(times['reuse']) / min(times['fresh']):.2f}")
            if args.timing_only:
                return 0
            for name, runtime, texts in (
                ("reuse", reuse, prompts[args.passes + 2 : 2 * args.passes + 2]),
                ("fresh", whole, [fresh] * args.passes),
            ):
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    for i, text in enumerate(texts):
                        first_token(runtime, text, 2000 + i)
                print(f"\n{name}: {args.passes} passes, ops by self CPU time")
                table = prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=44,
                    max_shapes_column_width=72,
                )  # fmt: skip
                print(table)
    return 0


def decode_cpu(runtime: Runtime, prompt: str, sampling: Sampling) -> float:
    """CPU seconds per decode token on this thread, with one torch thread (so all the work is this thread's, and
    other processes' load changes it little): Runtime._run's steps, the prefill's first token left out."""
    e = runtime.engine
    ids = e.encode_prompt(prompt, None, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with e.request(3000, RequestStats()):
            tokens = generate_ids(e.model, ids, sampling, e.eos_ids, threading.Event(), e.end_iteration)
            next(tokens)
            start = time.thread_time()
            n = sum(1 for _ in tokens)
            return (time.thread_time() - start) / n
    finally:
        torch.set_num_threads(threads)


def decode(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = with_context(demo_model_dir(), Path(tmp) / "demo")
        with Runtime.load(model, RuntimeConfig(device="cpu", prefix_cache_gb=0)) as runtime:
            runtime.generate("User: hello\nAssistant:", Sampling(greedy=True, max_new_tokens=2))
            no_eos = tuple((i, -100.0) for i in sorted(runtime.engine.eos_ids))  # every run decodes N tokens
            sampling = Sampling(greedy=True, max_new_tokens=args.decode, logit_bias=no_eos)
            system = system_prompt(runtime.engine.tokenizer, args.system_tokens)
            print(f"torch threads {torch.get_num_threads()}; {args.decode} tokens per run, medians of {args.repeats}")
            print(f"{'prompt tokens':>13} {'tokens':>7} {'ms/token':>9} {'CPU ms/token':>13}")
            for text in (f"System: {system}\nUser: tell me about the tides?\nAssistant:", "User: hello\nAssistant:"):
                runs = [runtime.generate(text, sampling) for _ in range(args.repeats)]
                ms = statistics.median(1000 * r.stats.tpot_s for r in runs)
                cpu_ms = 1000 * statistics.median(decode_cpu(runtime, text, sampling) for _ in range(args.repeats))
                print(f"{runs[0].stats.prompt_tokens:>13} {runs[0].stats.tokens:>7} {ms:>9.2f} {cpu_ms:>13.2f}")
    return 0


def client_ttft(runtime: Runtime, messages: list[dict] | str) -> tuple[float, float, int, int]:
    """(ms from the check to the first text event, the runtime's own TTFT in ms, prompt tokens, reused tokens)."""
    t0 = time.perf_counter()
    runtime.check(messages)
    handle = runtime.submit(messages, SAMPLING)
    next(iter(handle))
    ms = 1000 * (time.perf_counter() - t0)
    final = handle.result(60)
    return ms, 1000 * final.stats.ttft_s, final.stats.prompt_tokens, final.stats.cached_tokens


def client(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = with_context(demo_model_dir(), Path(tmp) / "demo")
        config = RuntimeConfig(device="cpu")
        with Runtime.load(model, config) as reuse, Runtime.load(model, config.with_changes(prefix_cache_gb=0)) as whole:
            system = system_prompt(reuse.engine.tokenizer, args.system_tokens)
            for r in (reuse, whole):
                client_ttft(r, [{"role": "user", "content": "hello"}])
            client_ttft(reuse, [{"role": "system", "content": system}, {"role": "user", "content": "Question 0?"}])
            sides: dict[str, list[tuple[float, float, int, int]]] = {"reuse": [], "fresh": []}
            for i in range(1, args.client + 1):
                chat = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Question {i} about tides?"},
                ]
                sides["reuse"].append(client_ttft(reuse, chat))
                # The same new tokens as a text prompt (no template to render: that stays on the reusing side only)
                sides["fresh"].append(client_ttft(whole, new_part(reuse, chat, sides["reuse"][-1][3])))
            print(f"torch threads {torch.get_num_threads()}; {args.client} pairs, interleaved")
            print(
                f"{'side':<6} {'prompt':>6} {'reused':>6} {'client min':>10} {'median':>8} {'runtime min':>11} {'median':>8}"
            )
            for name, runs in sides.items():
                client_ms, runtime_ms = [r[0] for r in runs], [r[1] for r in runs]
                print(
                    f"{name:<6} {runs[-1][2]:>6} {runs[-1][3]:>6} {min(client_ms):>10.1f} "
                    f"{statistics.median(client_ms):>8.1f} {min(runtime_ms):>11.1f} {statistics.median(runtime_ms):>8.1f}"
                )
            for i, what in ((0, "client"), (1, "runtime")):
                reuse_ms = [r[i] for r in sides["reuse"]]
                fresh_ms = [r[i] for r in sides["fresh"]]
                ratio = statistics.median(reuse_ms) / statistics.median(fresh_ms)
                print(f"{what}: ratio of medians {ratio:.2f}, of mins {min(reuse_ms) / min(fresh_ms):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
