"""Curated MoE models the runtime supports, with the facts the download wizard and fit estimates need.

Scope: static facts (sizes, shapes, which files to fetch). It does NOT download, probe the machine or decide
whether a model fits: `hardware.py` turns these facts plus a machine into a verdict, the UI downloads.

Sizes are decimal bytes (per expert format: `expert_bytes_for`). `expert_bytes` is one routed expert in bf16 (gate + up + down projections), i.e.
3·hidden·moe_intermediate·2 B; `resident_bytes` is everything that is not a routed expert, in bf16 (embeddings,
attention, norms, routers, shared experts, dense layers) — what has to live on the GPU; `embedding_bytes` the input
embedding table's share of it (vocabulary × hidden × 2 B), which a packed dense format leaves unpacked
(`resident_bytes_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1_000_000_000

# Files a checkpoint needs: weights, their index, config, tokenizer, chat template. Everything else (READMEs,
# images, original/ consolidated copies, GGUF/ONNX exports) is skipped.
DEFAULT_ALLOW = (
    "*.safetensors",
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)
DEFAULT_IGNORE = ("original/*", "metal/*", "onnx/*", "gguf/*", "*.gguf", "*.bin", "*.pth", "*.pt")


@dataclass(frozen=True)
class CatalogEntry:
    repo_id: str
    name: str
    family: str  # the transformers model_type
    total_params_b: float  # billions
    active_params_b: float
    num_layers: int  # MoE layers (L)
    num_experts: int  # routed experts per layer (J)
    top_k: int
    expert_bytes: int  # one routed expert, bf16
    resident_bytes: int  # non-expert weights, bf16
    download_bytes: int  # what the allowed files weigh on the Hub
    embedding_bytes: int = 0  # the input embedding table, bf16 (part of resident_bytes)
    note: str = ""
    native_format: str = "bf16"  # the experts' form in the download: what expert format auto keeps
    allow_patterns: tuple[str, ...] = DEFAULT_ALLOW
    ignore_patterns: tuple[str, ...] = field(default=DEFAULT_IGNORE)

    @property
    def experts_bytes(self) -> int:
        """All routed experts in bf16: what host RAM (or the disk tier) has to hold."""
        return self.num_layers * self.num_experts * self.expert_bytes

    def expert_bytes_for(self, fmt: str) -> int:
        """One routed expert stored as `fmt` (auto: the download's own form); expert_formats.BITS per weight."""
        from fmoe_local.expert_formats import bytes_per_expert

        return bytes_per_expert(self.expert_bytes, self.native_format if fmt == "auto" else fmt)

    def experts_bytes_for(self, fmt: str) -> int:
        """All routed experts stored as `fmt`: what host RAM (or the disk tier) holds."""
        return self.num_layers * self.num_experts * self.expert_bytes_for(fmt)

    def resident_bytes_for(self, dense_format: str) -> int:
        """The resident part with its linear weights stored as `dense_format` (dense_formats.py: bf16, int8, int4):
        the input embedding table stays bf16, everything else is counted at the format's bits per weight — routers
        and norms too, which stay unpacked, a few tens of MB at most (Qwen3-30B-A3B's 48 routers: 25 MB)."""
        from fmoe_local.expert_formats import BITS

        if dense_format == "bf16":
            return self.resident_bytes
        rest = self.resident_bytes - self.embedding_bytes
        return self.embedding_bytes + round(rest * BITS[dense_format] / 16)

    @property
    def local_name(self) -> str:
        """Folder name under the models directory."""
        return local_name(self.repo_id)


def local_name(repo_id: str) -> str:
    return repo_id.replace("/", "--")


def _expert(hidden: int, moe_intermediate: int) -> int:
    return 3 * hidden * moe_intermediate * 2


def _table(vocab: int, hidden: int) -> int:
    """The input embedding table in bf16 (none of the catalog's models ties it to the output head)."""
    return vocab * hidden * 2


CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        repo_id="allenai/OLMoE-1B-7B-0924-Instruct",
        name="OLMoE 1B-7B Instruct",
        family="olmoe",
        total_params_b=6.9,
        active_params_b=1.3,
        num_layers=16,
        num_experts=64,
        top_k=8,
        expert_bytes=_expert(2048, 1024),
        resident_bytes=int(0.9 * GB),
        download_bytes=int(13.8 * GB),
        embedding_bytes=_table(50304, 2048),
        note="Small and fully open; a good first download.",
    ),
    CatalogEntry(
        repo_id="Qwen/Qwen1.5-MoE-A2.7B-Chat",
        name="Qwen1.5-MoE A2.7B Chat",
        family="qwen2_moe",
        total_params_b=14.3,
        active_params_b=2.7,
        num_layers=24,
        num_experts=60,
        top_k=4,
        expert_bytes=_expert(2048, 1408),
        resident_bytes=int(3.7 * GB),
        download_bytes=int(28.6 * GB),
        embedding_bytes=_table(151936, 2048),
        note="Has a shared expert per layer (kept on the GPU).",
    ),
    CatalogEntry(
        repo_id="deepseek-ai/DeepSeek-V2-Lite-Chat",
        name="DeepSeek-V2-Lite Chat",
        family="deepseek_v2",
        total_params_b=15.7,
        active_params_b=2.4,
        num_layers=26,
        num_experts=64,
        top_k=6,
        expert_bytes=_expert(2048, 1408),
        resident_bytes=int(2.6 * GB),
        download_bytes=int(31.4 * GB),
        embedding_bytes=_table(102400, 2048),
        note="The model the bundled routing traces come from.",
    ),
    CatalogEntry(
        repo_id="openai/gpt-oss-20b",
        name="gpt-oss 20B",
        family="gpt_oss",
        total_params_b=20.9,
        active_params_b=3.6,
        num_layers=24,
        num_experts=32,
        top_k=4,
        expert_bytes=_expert(2880, 2880),
        resident_bytes=int(3.6 * GB),
        download_bytes=int(13.8 * GB),
        embedding_bytes=_table(201088, 2880),
        note="Ships in MXFP4; its experts stay in MXFP4 (4-bit) in RAM and on the GPU.",
        native_format="mxfp4",
    ),
    CatalogEntry(
        repo_id="Qwen/Qwen3-30B-A3B-Instruct-2507",
        name="Qwen3 30B-A3B Instruct",
        family="qwen3_moe",
        total_params_b=30.5,
        active_params_b=3.3,
        num_layers=48,
        num_experts=128,
        top_k=8,
        expert_bytes=_expert(2048, 768),
        resident_bytes=int(3.0 * GB),
        download_bytes=int(61.1 * GB),
        embedding_bytes=_table(151936, 2048),
    ),
    CatalogEntry(
        repo_id="microsoft/Phi-3.5-MoE-instruct",
        name="Phi-3.5-MoE Instruct",
        family="phimoe",
        total_params_b=41.9,
        active_params_b=6.6,
        num_layers=32,
        num_experts=16,
        top_k=2,
        expert_bytes=_expert(4096, 6400),
        resident_bytes=int(3.3 * GB),
        download_bytes=int(83.8 * GB),
        embedding_bytes=_table(32064, 4096),
    ),
    CatalogEntry(
        repo_id="mistralai/Mixtral-8x7B-Instruct-v0.1",
        name="Mixtral 8x7B Instruct",
        family="mixtral",
        total_params_b=46.7,
        active_params_b=12.9,
        num_layers=32,
        num_experts=8,
        top_k=2,
        expert_bytes=_expert(4096, 14336),
        resident_bytes=int(3.2 * GB),
        download_bytes=int(93.4 * GB),
        embedding_bytes=_table(32000, 4096),
        note="Needs the licence accepted on huggingface.co and a token.",
    ),
)


def find(repo_id: str) -> CatalogEntry | None:
    for entry in CATALOG:
        if entry.repo_id.lower() == repo_id.lower():
            return entry
    return None
