"""Dedup (posttrain.dedup through stages.curate.dedup): distinct problems kept apart, copies caught, the
boilerplate cap, bounded work. Each case runs through both near-duplicate methods."""

import pytest

from posttrain.config import ConfigError, Dedup, parse_params
from posttrain.dedup import METHODS, boilerplate, features, find_duplicates, resolve_method
from posttrain.schema import Problem
from stages.curate import dedup

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
DAPO = ("Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\nRemember to put "
        "your answer on its own line after \"Answer:\".")
SHORT = ["Simplify $\\sqrt{50}$.", "Simplify $\\sqrt{72}$.", "Evaluate $\\log_264$.", "Compute $\\dbinom{31}{28}$.",
         "What is $1^{(2^{235423523})}$?", "Find the units digit of $4^{10}$.", "Compute $\\tan 100^\\circ$.",
         "How many positive divisors does 196 have?", "Evaluate $\\lceil (3.6)^2 \\rceil$.", "Solve for $x$: $2x+3=9$."]
METHOD_NAMES = list(METHODS)


def _rows(prompts: list[str]) -> list[Problem]:
    return [Problem(id=f"r{i}", source="s", task="math", prompt=p, answer="1", solution=None)
            for i, p in enumerate(prompts)]


def _kept(prompts: list[str], method: str, **kw) -> list[str]:
    kept, _ = dedup(_rows(prompts), Dedup(method=method, **kw))
    return [r["id"] for r in kept]


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_problems_that_differ_in_their_numbers_are_kept_apart(method):
    """Before: "Simplify √50" and "Simplify √72" with MATH-500's shared suffix scored 10 shared of 11 5-grams
    (0.91 >= 0.8) and the second was dropped. Two rows only: the suffix is no boilerplate here (a cap needs
    more than 3 rows), so the numbers rule alone keeps them apart."""
    assert _kept([SHORT[0] + SUFFIX, SHORT[1] + SUFFIX], method) == ["r0", "r1"]
    assert _kept(["Tom has 3 apples and buys 2 more at the shop. How many apples now?",
                  "Tom has 3 apples and buys 5 more at the shop. How many apples now?"], method) == ["r0", "r1"]
    assert _kept(["Tom has three apples and buys two more at the shop. How many apples now?",
                  "Tom has three apples and buys four more at the shop. How many apples now?"], method) == ["r0", "r1"]


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_problems_with_swapped_numbers_or_flipped_signs_are_kept_apart(method):
    """The same numbers in another order, or with other signs, are another problem (a multiset of numbers
    merged both pairs: ngram scored them 0.81 and 0.76, minhash 0.70 and 0.62)."""
    assert _kept(["A car travels 60 miles in 2 hours at a steady pace. What is its average speed in mph?",
                  "A car travels 2 miles in 60 hours at a steady pace. What is its average speed in mph?"],
                 method) == ["r0", "r1"]
    assert _kept(["Find all the real roots of the polynomial x squared minus 4 x plus 3 and sum them up.",
                  "Find all the real roots of the polynomial x squared plus 4 x minus 3 and sum them up."],
                 method) == ["r0", "r1"]


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_templated_distinct_problems_are_kept_and_a_templated_copy_caught(method):
    """Before: short problems in DAPO-Math-17k's template shared its ~40 n-grams and were merged."""
    prompts = [DAPO.format(q=q) for q in SHORT] + [SHORT[3]]  # the last: a bare copy of a templated row
    kept, dups = dedup(_rows(prompts), Dedup(method=method))
    assert [r["id"] for r in kept] == [f"r{i}" for i in range(len(SHORT))]
    assert [(d["id"], d["duplicate_of"]) for d in dups] == [("r10", "r3")]


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_respaced_recased_and_latex_rewritten_copies_are_caught(method):
    a = "Tom has 3 apples, and buys 2 more. If he eats one, how many are left?"
    b = "  tom  HAS 3 apples , and buys\t2 more .  if he eats one , how many are left ?"
    c = "Find $\\frac{3}{4} \\cdot x^{2}$ when $x = 5$ and the answer is a fraction."
    d = "Find (3)/(4) * x^2 when x = 5 and the answer is a fraction."
    kept, dups = dedup(_rows([a, c, b, d]), Dedup(method=method))
    assert [r["id"] for r in kept] == ["r0", "r1"]
    assert {(x["id"], x["duplicate_of"], x["method"]) for x in dups} == {("r2", "r0", "exact"), ("r3", "r1", "exact")}


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_reordered_and_reworded_copies_are_near_duplicates(method):
    a = ("A farmer has 12 cows and 7 horses on his farm near the river. He sells 4 cows at the market on "
         "Monday. How many animals does the farmer have left on the farm?")
    b = ("He sells 4 cows at the market on Monday. How many animals does the farmer have left on the farm? "
         "A farmer has 12 cows and 7 horses on his farm near the river.")
    c = a.replace("How many", "What number of")
    kept, dups = dedup(_rows([a, b, c]), Dedup(method=method))
    assert [r["id"] for r in kept] == ["r0"]
    assert [(x["duplicate_of"], x["method"]) for x in dups] == [("r0", method)] * 2


def test_overlap_score_by_hand():
    """3-grams, one sentence each: 'alpha beta gamma delta epsilon' -> {abg, bgd, gde}; '... zeta' -> {abg,
    bgd, gdz}: 2 shared of min(3, 3) -> 2/3 = 0.667: a near duplicate at threshold 0.6, not at 0.7."""
    a, b = "alpha beta gamma delta epsilon", "alpha beta gamma delta zeta"
    assert _kept([a, b], "ngram", near_threshold=0.7) == ["r0", "r1"]
    _, dups = find_duplicates([a, b], Dedup(method="ngram", near_threshold=0.6))
    assert [(d.row, d.of, d.method, d.score) for d in dups] == [(1, 0, "ngram", 0.667)]


def test_boilerplate_cap_counts_rows_not_occurrences():
    """10 rows share the suffix; limit = max(3, 0.05 * 10) = 3 rows, so its n-grams (in 10 > 3) are
    boilerplate; 'how many' problems' shared 3-grams in 2 rows are not."""
    rows = [f"Problem {i}: how many ways are there to pick {i} balls? {SUFFIX}" for i in range(10)]
    common = boilerplate(rows, 3, frac=0.05, sample=20_000)
    assert "step by step" in common and "within boxed ." in common
    assert "how many ways" in common  # in all 10 rows too
    assert not boilerplate(rows[:3], 3, frac=0.05, sample=20_000)  # 3 rows: nothing is in more than 3
    two = boilerplate(rows[:2] + [f"Row {i} about trains {i}." for i in range(8)], 3, frac=0.05, sample=20_000)
    assert "how many ways" not in two
    assert features("Simplify √50.", 3).numbers != features("Simplify √72.", 3).numbers
    assert features("Find 2x.", 3).numbers == features("find $2 x$ .", 3).numbers  # digits split from letters


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_an_exact_copy_of_a_near_duplicate_names_the_kept_row(method):
    a = "Alice walks 5 km to school every day and 5 km back home. How far does she walk in 6 days in total?"
    b = a.replace("How far", "What distance")
    kept, dups = dedup(_rows([a, b, b]), Dedup(method=method))
    assert [r["id"] for r in kept] == ["r0"] and [d["duplicate_of"] for d in dups] == ["r0", "r0"]


def test_posting_lists_are_bounded_and_copies_still_found():
    """2,000 distinct rows sharing one long sentence (not boilerplate at frac 1.0): with max_postings=8 each
    row meets at most (its n-grams x 8) candidates, and a copy of row 1500 is still found by its own n-grams."""
    shared = "The same long sentence about a shop that sells red and blue pens to many customers every day"
    rows = [f"{shared}. Item {i} costs {i} dollars and weighs {i + 7} grams." for i in range(2000)] + [
        f"{shared}.  item 1500 costs 1500 DOLLARS and weighs 1507 grams ."]
    _, dups = find_duplicates(rows, Dedup(method="ngram", boilerplate_frac=1.0, max_postings=8))
    assert [(d.row, d.of) for d in dups] == [(2000, 1500)]


def test_auto_method_and_config():
    assert resolve_method(Dedup(auto_minhash_rows=100), 99) == "ngram"
    assert resolve_method(Dedup(auto_minhash_rows=100), 100) == "minhash"
    from posttrain.config import names

    assert names.DEDUP_METHODS == tuple(METHODS)
    from conftest import repo_params

    raw = repo_params()
    raw["curate"]["dedup"]["method"] = "simhash"
    with pytest.raises(ConfigError, match="curate.dedup.method"):
        parse_params(raw)
    raw["curate"]["dedup"].update(method="minhash", num_perm=8)
    with pytest.raises(ConfigError, match="curate.dedup.num_perm"):
        parse_params(raw)


def test_spill_partitions_group_equal_keys_by_hand(tmp_path):
    """5 records, 2 a partition -> 3 partitions; key % 3: 5->2, 6->0, 7->1, 8->2, 9->0, so the partitions read
    back in order are [6, 9], [7], [5, 8] (order kept within one), each file removed once read."""
    import numpy as np

    from posttrain.dedup.spill import Partitions

    dt = np.dtype([("key", "<u8"), ("row", "<u4")])
    parts = Partitions(tmp_path, dt, records=5, per_part=2)
    rec = np.zeros(5, dt)
    rec["key"], rec["row"] = [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]
    parts.add(rec[:3], rec["key"][:3])
    parts.add(rec[3:], rec["key"][3:])
    assert [p["key"].tolist() for p in parts] == [[6, 9], [7], [5, 8]]
    assert not list(tmp_path.iterdir())


def test_spill_partitions_wait_in_memory_until_their_buffer_fills(tmp_path):
    """Records wait in memory until ``buffer_bytes`` of them do, then go out a partition at a time: 2 adds of
    3 records (16 bytes each with padding: 48 bytes an add) under a 64-byte buffer leave the files empty after
    the first add (48 < 64) and full after the second (96 >= 64); reading back flushes whatever still waits."""
    import numpy as np

    from posttrain.dedup.spill import Partitions

    dt = np.dtype([("key", "<u8"), ("row", "<u4")], align=True)  # itemsize 16
    parts = Partitions(tmp_path, dt, records=9, per_part=3, buffer_bytes=64)
    rec = np.zeros(9, dt)
    rec["key"], rec["row"] = range(9), range(9)
    size = lambda: sum(f.stat().st_size for f in tmp_path.iterdir())  # noqa: E731
    parts.add(rec[:3], rec["key"][:3])
    assert size() == 0
    parts.add(rec[3:6], rec["key"][3:6])
    assert size() == 6 * 16
    parts.add(rec[6:], rec["key"][6:])  # 48 bytes wait: read back below all the same
    assert size() == 6 * 16
    assert [p["row"].tolist() for p in parts] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_iterating_found_duplicates_holds_a_chunk_not_every_duplicate_as_python_objects():
    """Iterating 10^6 duplicates holds a chunk of them as Python objects, not all: the four columns as lists
    would take ~110 MB (per duplicate: an int of ~28 bytes and a pointer of 8 for row and for of, a float of 24
    and a pointer for score, a pointer for method: ~112 bytes), a chunk of 16,384 about 1.8 MB."""
    import tracemalloc

    import numpy as np

    from posttrain.dedup import Found

    n = 10**6
    found = Found(np.arange(n) + 10**9, np.arange(n) + 10**9, np.zeros(n, np.uint8), np.full(n, 0.5, np.float32))
    tracemalloc.start()
    it = iter(found)
    first = next(it)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert (first.row, first.of, first.method, first.score) == (10**9, 10**9, "exact", 0.5)
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MiB held to yield the first duplicate"
    assert sum(1 for _ in it) == n - 1


def _corpus() -> list[str]:
    base = [f"A shop sells {i} red pens and {i + 3} blue pens on day {i}. How many pens does it sell?"
            for i in range(40)]
    near = [t.replace("How many pens", "What number of pens") for t in base[5:40:7]]  # 5 near copies
    exact = [t.upper() for t in base[::9]]  # 5 exact copies (case is normalised)
    return base + near + exact + [near[0]]  # and an exact copy of a near duplicate


def test_minhash_gives_the_same_duplicates_over_many_partitions(monkeypatch):
    """The spilled index grouped in 1 partition or in dozens (4 records a partition) finds the same duplicates:
    equal keys always meet, whatever the partition count."""
    from posttrain.dedup import spill

    cfg = Dedup(method="minhash", boilerplate_frac=1.0)
    _, one = find_duplicates(_corpus(), cfg)
    monkeypatch.setattr(spill, "PER_PART", 4)
    _, many = find_duplicates(_corpus(), cfg)
    got = [(d.row, d.of, d.method) for d in many]
    assert got == [(d.row, d.of, d.method) for d in one]
    assert [(r, o) for r, o, m in got if m == "exact"] == [(45, 0), (46, 9), (47, 18), (48, 27), (49, 36), (50, 5)]
    assert [(r, o) for r, o, m in got if m == "minhash"] == [(40, 5), (41, 12), (42, 19), (43, 26), (44, 33)]


def test_minhash_buckets_spend_their_cap_on_rows_with_the_same_numbers():
    """300 rows share three long sentences and differ only in their numbers, so they fill the same LSH buckets;
    a reworded copy of row 250 still meets row 250 with max_postings=4. (The numbers are in the bucket key, so a
    bucket holds only rows with the same numbers. The code before, which paired a row with the first 4 rows of
    its bucket whatever their numbers, also passes: the pair met in buckets keyed by their own numbered
    n-grams. This guards the folded key against losing the pair.)"""
    shared = ("The same long sentence about a shop that sells red and blue pens to many customers every day. The "
              "shop opens early in the morning and closes late at night when the last customer has gone home. Its "
              "owner keeps a careful list of every item on a shelf behind the counter near the door")
    rows = [f"{shared}. Item {i} costs {i} dollars and weighs {i + 7} grams." for i in range(300)]
    rows.append(f"{shared}. Item 250 is priced at 250 dollars and weighs 257 grams.")
    _, dups = find_duplicates(rows, Dedup(method="minhash", boilerplate_frac=1.0, max_postings=4))
    assert [(d.row, d.of, d.method) for d in dups] == [(300, 250, "minhash")]


def test_minhash_refuses_a_pair_whose_numbers_differ_even_when_their_band_keys_collide(monkeypatch):
    """The band key holds a 32-bit hash of the band and the numbers, so two rows with other numbers can share
    a key. Here the numbers' hashes are forced to differ by the inverse of the key's multiplier, so every band
    key of "sells 3" and "sells 4" is equal; the pair (Jaccard 0.75) must still be refused for its numbers.
    Before, candidates were confirmed by their signatures alone and the two problems were merged."""
    import posttrain.dedup.minhash as MH
    from posttrain.dedup.text import Features

    a = "A shop sells red pens and blue pens on a sunny day in the town market square. It sells 3 of them."
    b = a.replace("sells 3", "sells 4")
    inv = pow(int(MH._NUMS), -1, 2**64)
    real = MH.features

    def forced(t: str, n: int) -> Features:
        f = real(t, n)
        num = 12345 if "sells 3" in t else (12345 + inv) % 2**64
        return Features(f.digest, f.grams, num - 2**64 if num >= 2**63 else num)

    monkeypatch.setattr(MH, "features", forced)
    _, dups = find_duplicates([a, b], Dedup(method="minhash", boilerplate_frac=1.0))
    assert list(dups) == []


def test_found_rooted_names_kept_rows_and_leaves_the_callers_arrays_alone():
    """Row 2 repeats row 1, which repeats row 0: rooted() names row 0 for both (one hop, by hand), and the
    caller's `of` array is not written (it was, when rooted() rewrote the column in place)."""
    import numpy as np

    from posttrain.dedup import Found

    of = np.array([0, 1], np.int64)
    f = Found(np.array([1, 2], np.int64), of, np.array([2, 0], np.uint8), np.array([0.8, 1.0], np.float32))
    assert [(d.row, d.of, d.method) for d in f.rooted()] == [(1, 0, "minhash"), (2, 0, "exact")]
    assert of.tolist() == [0, 1]
