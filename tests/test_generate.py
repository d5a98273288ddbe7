"""fmoe_local/generate.py. The streaming detokenizer: its deltas, joined, are the tokenizer's own decode of every
id, for the tokenizers the supported families use (byte-level BPE: the tiny families' and the demo model's;
SentencePiece with byte fallback: Llama and Mixtral's), multi-byte characters and special tokens included, and a
token costs a small window's decode. Sampling a token (sample_next): top_k keeps only the k likeliest tokens; the
token loop hands the reply's tokens to the penalties (LogitsRules)."""

from __future__ import annotations

import copy
import json
import random
import threading
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, MixtralConfig, PreTrainedTokenizerFast

from fmoe_local.config import Sampling
from fmoe_local.demo import demo_model_dir
from fmoe_local.generate import Detokenizer, generate_ids, sample_next
from tests.tiny import FALLBACK_TEXT, train_tokenizer

TEXT = (
    "Grüße aus Köln, naïve café — 世界你好！こんにちは。Привет, мир. नमस्ते दुनिया. مرحبا بالعالم. "
    "🙂👍🏽 👩‍👩‍👧‍👦 🇫🇷🇯🇵 e\u0301 ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok. Don't stop; it's 3.14 (π), isn't it? "
) * 3
# Llama-2 and Mixtral's tokenizer.json decoder: "▁" to a space, <0xNN> pieces to bytes, the first space dropped.
LLAMA_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)


def _sentencepiece_like(decoder: decoders.Decoder) -> PreTrainedTokenizerFast:
    """A Llama-style BPE (Metaspace pieces, byte fallback, <s> and </s>), trained offline on the tests' text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([FALLBACK_TEXT, TEXT], trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _wordpiece_cleaning_up() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece whose decode cleans up spaces before punctuation (" ." → "."), as transformers does for
    every tokenizer that is not a BPE one and asks for it."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    tok.train_from_iterator([FALLBACK_TEXT, TEXT, "a ' b , c . d ? e ! do n't I 'm it 's we 've they 're"], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PreTrainedTokenizerFast]:
    return {
        "tiny families": train_tokenizer(tmp_path_factory.mktemp("tok")),
        "demo": AutoTokenizer.from_pretrained(demo_model_dir()),
        "llama decoder": _sentencepiece_like(LLAMA_DECODER),
        "metaspace decoder": _sentencepiece_like(decoders.Metaspace()),
        "wordpiece, cleaned up": _wordpiece_cleaning_up(),
    }


def _stream(tok: PreTrainedTokenizerFast, ids: list[int]) -> tuple[list[str], str]:
    detok = Detokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.rest()


def _check(tok: PreTrainedTokenizerFast, ids: list[int]) -> None:
    deltas, rest = _stream(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=True)


def test_the_deltas_are_the_decode_of_multilingual_and_emoji_text(tokenizers):
    for name, tok in tokenizers.items():
        ids = tok.encode(TEXT, add_special_tokens=False)
        assert len(ids) > 3 * Detokenizer.WINDOW, name  # the window moves many times
        _check(tok, ids)


def test_the_deltas_are_the_decode_of_long_random_ids_specials_and_broken_characters_included(tokenizers):
    """Random ids split characters between tokens, never complete some, and put special tokens anywhere."""
    for name, tok in tokenizers.items():
        rng = random.Random(name)
        for _ in range(6):
            ids = [rng.randrange(len(tok)) for _ in range(2000)]
            _check(tok, ids)


def test_the_deltas_are_the_decode_of_random_runs_of_real_text(tokenizers):
    """Pieces of real text in random order and with specials between them: the decoder sees real words, spaces and
    punctuation at every window boundary."""
    for name, tok in tokenizers.items():
        rng = random.Random(name)
        pieces = [tok.encode(w, add_special_tokens=False) for w in TEXT.split(" ")]
        specials = list(tok.all_special_ids)
        for _ in range(20):
            ids = []
            for _ in range(120):
                ids += rng.choice(pieces) if rng.random() > 0.1 else [rng.choice(specials)]
            _check(tok, ids)


def test_a_character_split_between_tokens_is_sent_whole(tokenizers):
    tok = tokenizers["tiny families"]
    ids = tok.encode("ab🙂", add_special_tokens=False)
    deltas, rest = _stream(tok, ids)
    assert len(tok.convert_ids_to_tokens(ids)) > 3  # the emoji's four bytes are more than one token
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == "ab🙂" and rest == ""


def test_text_is_sent_as_it_comes_and_a_spaced_word_held_back_only_where_a_cleanup_could_change_it(tokenizers):
    tok = tokenizers["demo"]
    text = "The router picks two experts for every token, and the cache holds them."
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _ = _stream(tok, ids)
    assert ["".join(deltas[:n]) for n in range(1, len(ids) + 1)] == [
        tok.decode(ids[:n]) for n in range(1, len(ids) + 1)
    ]
    wp = tokenizers["wordpiece, cleaned up"]
    ids = wp.encode("a ' b , c . d ? e !", add_special_tokens=False)
    held, rest = _stream(wp, ids)
    assert "".join(held) + rest == wp.decode(ids) == "a'b, c. d? e!"
    assert rest == " e!"  # a short last word after a space waits: " e" + "'" + "s" would clean up to "e's"


class _Counting:
    """The demo's tokenizer, counting the ids each decode is given."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok, self.sizes = tok, []
        self.backend_tokenizer = tok.backend_tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_token_decodes_a_window_of_ids_not_the_whole_reply(tokenizers):
    tok = _Counting(tokenizers["demo"])
    ids = tokenizers["demo"].encode(TEXT * 4, add_special_tokens=False)
    deltas, rest = _stream(tok, ids)
    # A window moves on once it holds WINDOW ids, when its text is whole (not mid-character): a little later at most.
    assert len(ids) > 500 and max(tok.sizes) <= 2 * Detokenizer.WINDOW
    assert len(tok.sizes) <= 2 * len(ids) + 1
    assert "".join(deltas) + rest == tokenizers["demo"].decode(ids, skip_special_tokens=True)


def test_text_is_the_decode_of_every_id_the_runtime_kept(tokenizers):
    """The runtime appends the EOS id itself (not streamed); `text` is the reply as the tokenizer decodes it."""
    tok = tokenizers["demo"]
    detok = Detokenizer(tok)
    for i in tok.encode("Hello there", add_special_tokens=False):
        detok.add(i)
    detok.ids.append(tok.eos_token_id)
    assert detok.text == "Hello there"


def test_every_tokenizer_here_is_the_kind_it_stands_for(tokenizers):
    """The stand-ins keep their decoders' traits: the Llama decoder drops the first space and joins byte pieces."""
    tok = tokenizers["llama decoder"]
    ids = tok.encode("hi 🙂", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("▁") and tok.decode(ids) == "hi 🙂"
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(tok.encode("🦀", add_special_tokens=False)))
    wp = tokenizers["wordpiece, cleaned up"]
    assert wp.decode(wp.encode("a , b .", add_special_tokens=False)) == "a, b."


LOGITS = torch.tensor([4.0, 3.0, 2.0, -1.0, 0.5])  # [V]


def draws(sampling: Sampling, n: int = 400) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {sample_next(LOGITS, sampling, generator) for _ in range(n)}


def test_top_k_keeps_only_the_k_likeliest_tokens():
    hot = Sampling(temperature=5.0, top_p=1.0)  # flat enough that every token comes up in 400 draws
    assert draws(hot) == {0, 1, 2, 3, 4}
    assert draws(Sampling(temperature=5.0, top_p=1.0, top_k=2)) == {0, 1}
    assert draws(Sampling(temperature=5.0, top_p=1.0, top_k=1)) == {0}
    assert draws(Sampling(temperature=5.0, top_p=1.0, top_k=50)) == {0, 1, 2, 3, 4}  # more than V: no limit


class _Favourite(torch.nn.Module):
    """A model whose next-token logits always prefer token 0, then 1, then 2: greedy repeats token 0 forever."""

    def __init__(self) -> None:
        super().__init__()
        self.config = MixtralConfig(num_hidden_layers=1)

    def forward(self, input_ids, past_key_values, use_cache, logits_to_keep):  # noqa: ANN001, ANN201
        return SimpleNamespace(logits=LOGITS[:3].expand(1, input_ids.shape[1], 3))


def reply(sampling: Sampling) -> list[int]:
    return list(generate_ids(_Favourite(), torch.tensor([[2]]), sampling, set(), threading.Event()))


def test_generate_ids_penalises_what_the_reply_already_said():
    assert reply(Sampling(greedy=True, max_new_tokens=4)) == [0, 0, 0, 0]
    # 4 − 1.5·count of token 0 falls under token 1's 3 after one use, and so on in turn
    assert reply(Sampling(greedy=True, max_new_tokens=4, frequency_penalty=1.5)) == [0, 1, 0, 2]
    assert reply(Sampling(greedy=True, max_new_tokens=3, repetition_penalty=4.0)) == [0, 1, 0]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"top_k": -1}, "Top-k"),
        ({"top_k": 2.5}, "Top-k"),
        ({"top_k": True}, "Top-k"),
        ({"repetition_penalty": 0.0}, "repetition penalty"),
        ({"repetition_penalty": float("nan")}, "repetition penalty"),
        ({"frequency_penalty": 2.5}, "frequency penalty"),
        ({"presence_penalty": float("nan")}, "presence penalty"),
    ],
)
def test_impossible_values_are_refused_in_a_sentence(changes, named):
    with pytest.raises(ValueError, match=named):
        Sampling(**changes).validate()


@pytest.mark.parametrize("name", ["tiny families", "llama decoder"])
def test_kept_special_tokens_stream_in_place_and_the_others_are_left_out(tokenizers, name):
    """A request whose parser reads some special tokens (a tool-call format's markers) gets their text where they
    were generated; every other special token is still left out, and the text around them is the same."""
    tok = copy.deepcopy(tokenizers[name])  # the module's tokenizers stay as they are
    if "<|user|>" not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    marker, other = tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    words = [tok.encode(w, add_special_tokens=False) for w in ("Hello there, ", "caf\u00e9 🙂", " done")]
    ids = [*words[0], marker, *words[1], other, marker, *words[2], other]
    detok = Detokenizer(tok, keep=frozenset({"<|user|>"}))
    deltas = [detok.add(i) for i in ids]
    whole = "".join(deltas) + detok.rest()
    assert whole == detok.text and whole.count("<|user|>") == 2 and "<|assistant|>" not in whole, deltas
    # Without the markers it is the text as before, and each marker sits where its token was.
    assert whole.replace("<|user|>", "") == tok.decode(ids, skip_special_tokens=True)
    parts = whole.split("<|user|>")
    assert parts[0] == tok.decode(words[0], skip_special_tokens=True) and parts[1].strip() == "café 🙂"
    assert deltas[len(words[0])].endswith("<|user|>")
    plain, rest = _stream(tok, ids)
    assert "".join(plain) + rest == tok.decode(ids, skip_special_tokens=True)  # nothing kept unless asked
