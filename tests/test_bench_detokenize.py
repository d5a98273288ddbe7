from __future__ import annotations

from fmoe_bench import detokenize


def test_the_table_times_both_detokenizers_on_the_same_reply_and_both_give_its_text(capsys):
    assert detokenize.main(["--tokens", "60", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "demo model's tokenizer, a 60-token reply, best of 1"
    rows = [line for line in out if line.startswith(("re-decode", "window"))]
    assert len(rows) == 2 and all(row.endswith("True") for row in rows)


def test_the_reference_is_the_old_detokenizer_a_whole_reply_decoded_per_token():
    class Counting:
        sizes: list[int] = []

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            self.sizes.append(len(ids))
            return "x" * len(ids)

    tok = Counting()
    assert detokenize.redecode_all(tok, list(range(5))) == "xxxxx" and tok.sizes == [1, 2, 3, 4, 5]
