import math

from lossless_rules import chat_prompt_ids, gap_to_best, is_near_tie, with_token_entry

TOP = [(-0.50, 40, "4"), (-0.50, 36, "0"), (-0.50, 34, "2"), (-1.75, 9, "x")]


def test_a_third_token_tied_with_the_best_is_a_near_tie():
    assert gap_to_best(TOP, 34) == 0.0 and is_near_tie(TOP, 34, 0.25)


def test_a_clear_loser_or_an_unlisted_token_is_not_excused():
    assert gap_to_best(TOP, 9) == 1.25 and not is_near_tie(TOP, 9, 0.5)
    assert gap_to_best(TOP, 7) == math.inf and not is_near_tie(TOP, 7, 100.0)


def test_a_token_below_the_listed_few_is_measured_from_its_own_log_prob():
    top = with_token_entry(TOP, [(-3.0, 7, "z")], 7)
    assert top[:4] == [t[:2] for t in TOP] and gap_to_best(top, 7) == 2.5
    assert is_near_tie(top, 7, 2.5) and not is_near_tie(top, 7, 2.0)
    assert with_token_entry(TOP, [(-0.5, 34, "2")], 34) == [t[:2] for t in TOP]  # listed once


def test_chat_prompts_are_templated_ids_in_a_seeded_order():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt and msgs[0]["role"] == "user"
            return msgs[0]["content"]

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [len(text), 0]}

    texts = ["a", "bb", "ccc", "dddd"]
    a, b = chat_prompt_ids(Tok(), texts, seed=1), chat_prompt_ids(Tok(), texts, seed=1)
    assert a == b and sorted(ids[0] for ids in a) == [1, 2, 3, 4] and all(ids[1] == 0 for ids in a)
