import pytest
from conftest import BENCH

from posttrain.config import Dedup
from posttrain.decontam import build_index, grams, ngrams, normalize, sentences, words
from posttrain.schema import Problem
from stages.curate import dedup

SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def test_normalize_and_words():
    assert normalize("  Apples,\tShe  SAID\n") == "apples, she said"
    assert words("apples , she") == words("Apples,she") == ["apples", ",", "she"]
    assert ngrams(["a", "b"], 8) == {"a b"}  # shorter than n: the whole text is one n-gram
    assert ngrams(["a", "b", "c"], 2) == {"a b", "b c"}


def test_latex_and_its_plain_rewrites_normalize_alike():
    forms = ["Find $\\frac{x+1}{2} \\cdot y^{2}$.", "Find (x+1)/(2) * y^2.", "find x+1/2 * y^2.",
             "Find $\\left(\\dfrac{x+1}{2}\\right) \\times y^{2}$."]
    assert len({tuple(words(f)) for f in forms}) == 1, [words(f) for f in forms]


def test_reordered_sentences_have_the_same_grams():
    a = "Tom has three red apples in a bag at home. He buys two more apples at the shop today. How many now?"
    b = "He buys two more apples at the shop today. How many now? Tom has three red apples in a bag at home."
    assert grams(a, 8) == grams(b, 8)
    assert sentences(words("It costs 3.5 dollars. Then 2.")) == [["it", "costs", "3", ".", "5", "dollars", "."],
                                                                 ["then", "2", "."]]  # a decimal point is no end


def test_short_prompts_are_caught_and_distinguished():
    idx = build_index([("e1", "12*7="), ("e2", "4738*7=")], n=8, boilerplate_frac=0.2)
    assert idx.query("12 * 7 =").score == 1.0  # re-spaced short prompt: same single n-gram
    assert idx.query("12*8=") is None


def test_boilerplate_suffix_alone_does_not_match():
    items = [(f"b{i}", f"Problem number {i} asks about the {w} of a triangle with sides {i}. {SUFFIX}")
             for i, w in enumerate(["area", "perimeter", "angle", "height", "median"] * 4)]
    idx = build_index(items, n=8, boilerplate_frac=0.2)
    assert idx.boilerplate  # the shared instruction's n-grams were dropped
    m = idx.query(f"How many apples does Tom have if he buys three bags? {SUFFIX}")
    assert m is None or m.score < 0.5
    assert idx.query(items[3][1].upper()).score == 1.0  # a re-cased copy is still caught


def test_item_embedded_in_longer_row_is_caught():
    item = "a train travels two hundred and seventy miles in three hours at a constant speed what is its speed"
    idx = build_index([("t1", item)], n=8, boilerplate_frac=0.2)
    row = "Here is a warm-up. " + item + " Then answer five unrelated questions about geometry and algebra please"
    m = idx.query(row)
    assert m.item_id == "t1" and m.score == 1.0  # every n-gram of the item is in the row


def test_near_duplicate_dedup_keeps_first():
    rows = [Problem(id=f"s:{i}", source="s", task="math", prompt=p, answer="1", solution=None) for i, p in
            enumerate(["Tom has three apples and buys two more apples at the shop today",
                       "tom has three apples and buys two more apples at the shop today!",
                       "A completely different question about trains and miles per hour here"])]
    kept, dups = dedup(rows, Dedup())
    assert [r["id"] for r in kept] == ["s:0", "s:2"]
    assert dups[0]["duplicate_of"] == "s:0"


TARGETS = {"verbatim": 0.99, "recase_respace": 0.99, "wrapped": 0.99, "reordered": 0.99, "latex_rewritten": 0.95,
           "truncated_60": 0.95}


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.is_dir(), reason="no benchmark files: $POSTTRAIN_BENCH unset or empty")
def test_rewritten_copies_are_caught_without_false_positives():
    """100 rewritten copies per kind (tests/perturb.py, seeded) of GSM8K-test / MATH-500 / AIME / AMC items
    planted into the 7,473 real GSM8K-train rows: recall per kind, and clean train rows flagged (<= 0.3%)."""
    import perturb

    res = perturb.measure(per_kind=100, seed=0)
    print(f"\nrecall {res['recall']}; clean GSM8K-train flagged {res['false_positives']}/{res['clean_rows']} "
          f"({res['fp_ids']}); methods {res['methods']}; {res['seconds']} s")
    for kind, target in TARGETS.items():
        assert res["recall"][kind] >= target, (kind, res["recall"][kind])
    assert res["false_positive_rate"] <= 0.003
    assert set(res["methods"]) <= {"exact", "ngram:row-in-item", "ngram:item-in-row"}
