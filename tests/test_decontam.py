import json
import random

import pytest
from conftest import BENCH

from posttrain.config import Decontam
from posttrain.decontam import build_index, ngrams, normalize, words
from posttrain.schema import Problem
from stages.curate import decontaminate, dedup

SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def test_normalize_and_words():
    assert normalize("  Apples,\tShe  SAID\n") == "apples, she said"
    assert words("apples , she") == words("Apples,she") == ["apples", ",", "she"]
    assert ngrams(["a", "b"], 8) == {"a b"}  # shorter than n: the whole text is one n-gram
    assert ngrams(["a", "b", "c"], 2) == {"a b", "b c"}


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
    kept, dups = dedup(rows, n=5, threshold=0.8)
    assert [r["id"] for r in kept] == ["s:0", "s:2"]
    assert dups[0]["duplicate_of"] == "s:0"


def _load(name, key):
    with open(BENCH / name) as f:
        return [json.loads(line)[key] for line in f]


def _perturb(text: str, rng: random.Random) -> str:
    """Light edits a scraped copy would carry: re-case, re-space, dropped instruction, one word changed."""
    t = text.replace(SUFFIX, "").strip()
    t = rng.choice([str.upper, str.lower, str.title, lambda s: s])(t)
    t = t.replace(", ", " , ").replace(". ", ".  ").replace("\n", " ")
    toks = t.split(" ")
    if len(toks) > 12:
        toks[rng.randrange(len(toks))] = "something"
    return " ".join(toks)


@pytest.mark.skipif(not BENCH.is_dir(), reason="../shared/benchmarks not present")
def test_planted_contamination_in_real_gsm8k_train():
    rng = random.Random(0)
    train = _load("gsm8k_train.jsonl", "question")
    gsm_test = _load("gsm8k_test.jsonl", "question")
    math500 = _load("math500.jsonl", "problem")
    planted = [("gsm8k_test", q) for q in rng.sample(gsm_test, 25)] + [("math500", q) for q in rng.sample(math500, 25)]
    rows = [Problem(id=f"train:{i}", source="train", task="math", prompt=q, answer="1", solution=None)
            for i, q in enumerate(train)]
    rows += [Problem(id=f"planted:{b}:{i}", source="planted", task="math", prompt=_perturb(q, rng), answer="1",
                     solution=None) for i, (b, q) in enumerate(planted)]
    benches = {"gsm8k_test": [(f"t:{i}", q) for i, q in enumerate(gsm_test)],
               "math500": [(f"m:{i}", q) for i, q in enumerate(math500)]}
    _, bad, report = decontaminate(rows, benches, Decontam())
    caught = sum(1 for r in bad if r.startswith("planted:"))
    false_pos = sorted(r for r in bad if r.startswith("train:"))
    recall, fp_rate = caught / len(planted), len(false_pos) / len(train)
    print(f"\nplanted recall {caught}/{len(planted)} = {recall:.3f}; "
          f"clean GSM8K-train flagged {len(false_pos)}/{len(train)} = {fp_rate:.4f} ({false_pos})")
    assert recall >= 0.95
    assert fp_rate <= 0.002
    assert report["benchmarks"]["math500"]["boilerplate_ngrams"] > 0  # the shared instruction was dropped
