"""RuntimeConfig: the one place every runtime default lives.

Scope: plain data. It does NOT probe hardware, read files or validate against a model; `Runtime.load` resolves
"auto" values once, and `hardware.py` is where the machine is probed when the app asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

POLICIES = ("fmoe", "moe_infinity", "lru", "lfu", "speculative", "on_demand", "cpu_moe")
MISS_HANDLING = ("auto", "copy", "cpu")
SEMANTIC_MODES = ("running_mean", "token")
EXPERT_FORMATS = ("auto", "bf16", "int8", "int4", "nf4")  # expert_formats.py describes each
DENSE_FORMATS = ("auto", "bf16", "int8", "int4")  # dense_formats.py describes each
DENSE_INT8_PRODUCTS = ("auto", "torch", "openvino")  # dense_formats.int8_product describes each
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes; a larger seed overflowed mid-request
PREFIX_AUTO_MAX_GB = 4.0  # the automatic prefix cache size's ceiling (RuntimeConfig.prefix_cache_gb)


@dataclass(frozen=True)
class ThoughtBudget:
    """At most `tokens` tokens of the model's thinking (the Anthropic API's budget_tokens): once the thought holds
    that many, the runtime writes `close` for the model and the reply goes on as the answer (logits_rules.py). The
    markers are texts, tokenized with the model's own tokenizer: `start` opens a thought when the reply begins with
    it ("<think>"), `end` is the model's own close ("</think>"), `close` what is forced ("\\n</think>\\n\\n", as
    Qwen's templates write a closed thought); `opened`: the prompt opened the thought, so the reply starts inside it."""

    tokens: int
    start: str
    end: str
    close: str
    opened: bool = False

    def validate(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError("The thinking budget must be a whole number of tokens, 0 or more.")
        if not (self.start and self.end and self.close):
            raise ValueError("A thinking budget needs the texts that open, end and close the model's thought.")


@dataclass(frozen=True)
class Sampling:
    """How one reply is sampled. `greedy` overrides temperature, top_p and top_k; the penalties apply either way
    (logits_rules.py). Defaults leave the model's distribution as it is but for temperature and top-p."""

    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.9
    # Only the k likeliest tokens may be sampled (the Anthropic API's top_k, the chat's Top-k); 0 keeps every token,
    # as transformers' top_k=0 does.
    top_k: int = 0
    # > 1 makes every token already in the prompt or the reply less likely (transformers' rule: logit / p if
    # positive, · p if negative); 1 = off.
    repetition_penalty: float = 1.0
    # OpenAI's penalties on the reply's own tokens: logit − frequency · count − presence · (count > 0); 0 = off.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    greedy: bool = False
    seed: int | None = None
    # OpenAI's logit changes (logits_rules.py applies every penalty and the bias): a bias per token id, -100 to 100.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The grammar the reply must follow (constrained.py's grammar text), or None: any text.
    grammar: str | None = None
    # The most tokens the reply's thought may take before its end is written for the model; None: no limit.
    thought: ThoughtBudget | None = None

    def validate(self) -> None:
        """Raise ValueError with a sentence a user can act on. Written as `not <in range>` so that NaN, which
        fails every comparison, is refused too (it made every sampled token a torch error)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("Temperature must be 0 (the most likely reply) or a positive number, ~0.7 for variety.")
        if not 0 <= self.top_p <= 1:
            raise ValueError("Top-p must be a number from 0 to 1 (1 keeps every token, 0.9 the likeliest nine tenths).")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError("Max new tokens must be a whole number of at least 1.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError("Top-k must be a whole number: 0 keeps every token, 40 the likeliest forty.")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("The repetition penalty must be a positive number: 1 is off, 1.1 a mild penalty.")
        for name, value in (("frequency", self.frequency_penalty), ("presence", self.presence_penalty)):
            if not -2 <= value <= 2:
                raise ValueError(f"The {name} penalty must be a number from -2 to 2 (0 is off).")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"The seed must be a whole number from 0 to {MAX_SEED}, or left out.")
        if not all(-100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ValueError("Each logit bias must be a number from -100 to 100.")
        if self.thought is not None:
            self.thought.validate()


@dataclass(frozen=True)
class RuntimeConfig:
    # Where the non-expert weights and the expert cache live: "auto" picks cuda when available.
    device: str = "auto"
    # Compute dtype: "auto" keeps the checkpoint's dtype (bf16 → bf16); on the CPU bf16 only where this CPU decodes
    # in it about as fast as in float32, or where the experts are int8/int4 and torch's products for them are faster
    # with bf16 activations (both measured at load: dtype_verdicts.resolve_dtype), fp16 never, else float32.
    dtype: str = "auto"
    # Expert cache budget on the device. cache_experts (a count) wins over cache_gb when both are given.
    cache_gb: float = 4.0
    cache_experts: int | None = None
    # d: how many layers ahead the matcher predicts.
    prefetch_distance: int = 3
    # Choose d from the link and the model instead (prefetch_distance.py): after each request, ⌈copy time of one
    # expert (measured at load) / compute time of one layer (that request's decode)⌉ + 1, the rule `bench replay
    # --prefetch-distance auto` uses. Off by default: it gained 1–2 points of hit rate in the replay (docs/bench.md,
    # "Generalising") but has not been measured live on a GPU yet. Without a GPU it changes nothing (no copies).
    prefetch_distance_auto: bool = False
    policy: str = "fmoe"
    # What happens to an expert the cache lacks: "copy" loads it into a slot, "cpu" computes it on the host from its
    # host copy (hidden states go down, [T, H] comes back), "auto" shares each layer's misses between the two from
    # the measured costs (miss_cost.py: they work at once; a prefill's expert mostly goes to the copy). Without a GPU,
    # auto computes every miss on the CPU: a copy would only duplicate it in RAM.
    miss_handling: str = "auto"
    # C: expert maps kept by the map store. More history finds closer matches and longer successor chains: on the
    # shared traces 1000/2000/4000/8000 maps gave pooled hit rates 0.605/0.616/0.628/0.638 (docs/bench.md, session
    # 3). 4000 is a cost choice, not a peak: ~16 KB per map for a 26×64-expert, 2048-wide model (64 MB of RAM),
    # and the searches stay far under the matcher's 1 ms per layer, which is measured at 32K maps.
    store_capacity: int = 4000
    # k: semantic embeddings longer than this are searched through a random projection to k dimensions (0 = always
    # the exact full scan); 256 keeps a 32K-map search under 1 ms per layer (docs/bench.md, "Matcher").
    sketch_dim: int = 256
    # m: maps whose exact cosine (and exact RDY) re-ranks the sketch's best guesses. 128 full rows cost little next
    # to the sketch scan; on mean token embeddings fewer candidates measurably miss the exact best (docs/bench.md,
    # "Matcher").
    sketch_candidates: int = 128
    # How routed experts are stored in RAM and in the cache slots: "bf16" unquantised (the checkpoint's dtype),
    # "int8" (~2× smaller), "int4" and "nf4" (4-bit, ~4× smaller, slightly different answers; int4 is computed by
    # torch's weight-only kernels on a CPU, nf4 dequantised), "auto" the checkpoint's own form
    # (a bf16 checkpoint stays bf16, GPT-OSS's MXFP4 stays packed, a bitsandbytes 4-bit checkpoint stays nf4).
    # A quantised copy made from a bf16 checkpoint is kept in `quant_cache_dir` (None = the user data folder's
    # quantized/), so only the first load quantises.
    expert_format: str = "auto"
    # How the linear weights outside the routed experts (attention, output head, shared experts, dense MLP layers;
    # never routers, gates, embeddings or norms) are stored: "bf16" the checkpoint's own dtype, unquantised; "int8"
    # or "int4" packed and multiplied by torch's weight-only CPU products (a CPU device only: refused on a GPU);
    # "auto" follows the experts on a CPU device when they are int8 or int4 (a CPU decode reads every dense weight
    # per token, as llama.cpp's Q8_0/Q4_0 files quantise them), else unquantised (dense_formats.py).
    dense_format: str = "auto"
    # Which product multiplies the dense weights packed int8: "openvino" (OpenVINO's CPU plugin, float32 activations:
    # openvino_products.py), "torch" (torch's `_weight_int8pack_mm`), "auto" the one measured faster on this machine
    # for weights of that size (an output head, an attention projection: dtype_verdicts.py), torch's where openvino
    # cannot be imported. Forcing "openvino" where it cannot run refuses
    # the load.
    dense_int8_product: str = "auto"
    quant_cache_dir: str | None = None
    # Host RAM for expert weights; None = what the RAM available at load holds, less the fit verdicts' headroom
    # (hardware.host_ram_budget_gb). What does not fit is read from the checkpoint per use.
    host_ram_gb: float | None = None
    # On a GPU, how much of that RAM to page-lock ("pin") so that copies go straight from it to the device at the
    # link's full rate, with no staging copy on the host. None = up to half of the machine's RAM (pinned memory
    # cannot be swapped out, so pinning all of it would starve everything else); 0 = never (every copy is staged).
    pinned_ram_gb: float | None = None
    # Semantic embedding of an iteration: running mean over the request's tokens, or the iteration's tokens only.
    semantic_mode: str = "running_mean"
    sampling: Sampling = field(default_factory=Sampling)
    # Run the matcher and the copies inline on the forward thread: deterministic hit counts for tests and for
    # comparing the runtime with the replay benchmark. Off for real use (the paper keeps them off the critical path).
    synchronous_prefetch: bool = False
    # The longest the forward pass waits for one expert to load, or a request's end for the prefetcher to finish,
    # before it gives up with a sentence: a consumer disk reads a 350 MB Mixtral expert in well under 10 s, so this
    # only ends waits on a failing disk or a stuck read. Stop and close end every wait sooner.
    load_timeout_s: float = 60.0
    # Experts are copied to the device in chunks of this many MB: a prefetch gives way to an on-demand load between
    # chunks, so a demand load waits for at most one chunk of a prefetch instead of a whole (up to 350 MB) expert,
    # while tens of MB per copy keep PCIe near its full rate. Also the size of each of the two pinned staging buffers.
    copy_chunk_mb: float = 32.0
    # Record what the runtime saw to this .npz (trace format, DESIGN.md). None = no recording.
    record_trace: str | None = None
    # Memory for the KV caches kept after each request, so that the next request sharing a prompt prefix (the next
    # turn of a chat, an agent's long system prompt, a regenerate or edit) prefills only what is new
    # (prefix_cache.py). It lives where the KV cache does (the GPU, else RAM) and comes on top of the running
    # request's own KV cache. None = a quarter of what is free there after load, at most PREFIX_AUTO_MAX_GB: a
    # 20,000-token conversation of a 48-layer model with 4 KV heads of 128 is ~2 GB in bf16; 0 = keep nothing.
    prefix_cache_gb: float | None = None

    def with_changes(self, **changes: object) -> RuntimeConfig:
        return replace(self, **changes)

    def validate(self) -> None:
        """Raise ValueError with a sentence a user can act on."""
        if self.policy not in POLICIES:
            raise ValueError(f"Unknown policy '{self.policy}'. Choose one of: {', '.join(POLICIES)}.")
        if self.miss_handling not in MISS_HANDLING:
            raise ValueError(
                f"Unknown miss handling '{self.miss_handling}'. Choose auto (share each layer's misses between the copy and the processor), copy (load it into the "
                "cache) or cpu (compute it on the processor)."
            )
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(
                f"Unknown expert format '{self.expert_format}'. Choose auto (the checkpoint's own), bf16 (full size), "
                "int8 (8-bit), int4 or nf4 (4-bit)."
            )
        if self.dense_format not in DENSE_FORMATS:
            raise ValueError(
                f"Unknown dense format '{self.dense_format}'. Choose auto (as the experts on a CPU, else unquantised), "
                "bf16 (unquantised), int8 (8-bit) or int4 (4-bit); int8 and int4 run on a CPU device only."
            )
        if self.dense_int8_product not in DENSE_INT8_PRODUCTS:
            raise ValueError(
                f"Unknown dense int8 product '{self.dense_int8_product}'. Choose auto (the faster one on this "
                "machine), torch or openvino."
            )
        if self.semantic_mode not in SEMANTIC_MODES:
            raise ValueError(
                f"Unknown semantic mode '{self.semantic_mode}'. Choose one of: {', '.join(SEMANTIC_MODES)}."
            )
        if self.cache_experts is None and not (math.isfinite(self.cache_gb) and self.cache_gb > 0):
            raise ValueError("The expert cache needs more than 0 GB. Set cache GB to a positive number.")
        if self.cache_experts is not None and self.cache_experts < 1:
            raise ValueError("The expert cache needs at least one expert slot.")
        if self.prefetch_distance < 1:
            raise ValueError("Prefetch distance must be at least 1 layer.")
        if self.store_capacity < 1:
            raise ValueError("The map store needs room for at least one expert map.")
        if self.sketch_dim < 0:
            raise ValueError("Set the semantic sketch size to 0 (exact search) or a positive number of dimensions.")
        if self.sketch_candidates < 1:
            raise ValueError("Set the semantic sketch candidates to at least 1: that many maps are re-ranked exactly.")
        if not (math.isfinite(self.load_timeout_s) and self.load_timeout_s > 0):
            raise ValueError("Set the load timeout to a positive number of seconds.")
        if self.host_ram_gb is not None and not (math.isfinite(self.host_ram_gb) and self.host_ram_gb >= 0):
            raise ValueError("Set the host RAM for experts to 0 GB or a positive number of GB, or leave it on auto.")
        if self.pinned_ram_gb is not None and not (math.isfinite(self.pinned_ram_gb) and self.pinned_ram_gb >= 0):
            raise ValueError("Set the pinned RAM to 0 GB (never pin) or a positive number of GB, or leave it on auto.")
        if not (math.isfinite(self.copy_chunk_mb) and self.copy_chunk_mb > 0):
            raise ValueError("Set the copy chunk to a positive number of MB (32 is a good size).")
        if self.prefix_cache_gb is not None and not (math.isfinite(self.prefix_cache_gb) and self.prefix_cache_gb >= 0):
            raise ValueError(
                "Set the prefix cache to 0 GB (prefill every prompt whole) or a positive number of GB, or leave it on "
                "auto."
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"Unknown device '{self.device}'. Use auto, cpu or cuda.")
        self.sampling.validate()
