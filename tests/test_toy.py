"""The synthetic toy task: determinism, lengths, and German grammar checked by hand."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from itertools import islice

import pytest

from aiayn.data import toy
from aiayn.data.toy import clause, generate_pairs, noun_phrase, prepositional_phrase

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBORDINATORS = {"weil", "dass", "obwohl", "wenn", "als", "während"}
RELATIVE_PRONOUNS = {"der", "die", "das", "den", "dem", "denen"}


def words(sentence: str) -> list[str]:
    return sentence.split()


def digest(pairs) -> str:
    return hashlib.sha256(repr(list(pairs)).encode()).hexdigest()


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str]]:
    return list(generate_pairs(5000, 11))


def finite_forms() -> set[str]:
    """Every finite German verb form the lexicon can produce, separable prefixes attached."""
    forms = set()
    for verbs in toy._VERBS.values():
        for v in verbs:
            forms.update(v.de_pres, v.de_past, (v.prefix + f for f in v.de_pres))
    for table in toy._FIN.values():
        forms.update(table)
    return forms


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_pairs_different_seed_different_pairs():
    a = list(generate_pairs(300, 5))
    assert a == list(generate_pairs(300, 5))
    b = list(generate_pairs(300, 6))
    assert sum(x != y for x, y in zip(a, b, strict=True)) > 250


def test_prefix_property():
    long = list(generate_pairs(400, 3, 2, 30))
    for k in (0, 1, 17, 399):
        assert list(generate_pairs(k, 3, 2, 30)) == long[:k]
    assert list(islice(generate_pairs(10**9, 3, 2, 30), 50)) == long[:50]


def test_deterministic_across_processes_and_hash_seeds():
    here = digest(generate_pairs(200, 42))
    code = "from aiayn.data.toy import generate_pairs; import hashlib; " \
           "print(hashlib.sha256(repr(list(generate_pairs(200, 42))).encode()).hexdigest())"
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert out == here


def test_generated_pairs_are_mostly_distinct(pairs):
    assert len(set(pairs)) > 0.95 * len(pairs)


# --------------------------------------------------------------------------- lengths


@pytest.mark.parametrize(("lo", "hi", "n"), [(3, 8, 3000), (3, 40, 5000), (12, 20, 1000),
                                              (2, 2, 50)])
def test_lengths_within_bounds_and_reach_them(lo, hi, n):
    got = list(generate_pairs(n, 9, lo, hi))
    assert len(got) == n
    lengths = [len(words(s)) for pair in got for s in pair]
    assert all(lo <= k <= hi for k in lengths)
    assert min(lengths) == lo
    if hi - lo > 10:
        assert max(lengths) >= hi - 2
    else:
        assert max(lengths) == hi


def test_default_length_distribution_looks_like_a_corpus(pairs):
    en = sorted(len(words(e)) for e, _ in pairs)
    mean = sum(en) / len(en)
    assert 9 <= mean <= 16
    assert en[len(en) // 2] < mean  # right-skewed: many short sentences, a long tail
    assert sum(k >= 30 for k in en) >= 50


def test_impossible_bounds_are_refused():
    with pytest.raises(ValueError):
        list(generate_pairs(1, 0, 5, 4))
    with pytest.raises(ValueError):
        list(generate_pairs(1, 0, 1, 1))


# --------------------------------------------------------------------------- surface


def test_capitalised_and_final_period(pairs):
    for en, de in pairs:
        for s in (en, de):
            assert s[0].isupper() and s.endswith(".") and not s.endswith(",.")
            assert "  " not in s and " ," not in s


def test_vocabulary_size(pairs):
    for side in (0, 1):
        vocab = {w.strip(".,").lower() for p in pairs for w in words(p[side])}
        assert 150 <= len(vocab) <= 1000, len(vocab)


def test_german_has_umlauts_and_eszett(pairs):
    german = " ".join(de for _, de in pairs[:1000])
    assert any(ch in german for ch in "äöü")
    assert "ß" in german
    assert all(en.isascii() for en, _ in pairs[:1000])


# --------------------------------------------------------------------------- agreement


@pytest.mark.parametrize(("args", "expected"), [
    (dict(noun="dog", adjectives=["small"]), ("the small dog", "der kleine Hund")),
    (dict(noun="dog", adjectives=["small"], plural=True), ("the small dogs", "die kleinen Hunde")),
    (dict(noun="dog", adjectives=["small"], case="acc"), ("the small dog", "den kleinen Hund")),
    (dict(noun="dog", adjectives=["small"], case="dat"), ("the small dog", "dem kleinen Hund")),
    (dict(noun="house", adjectives=["small"]), ("the small house", "das kleine Haus")),
    (dict(noun="cat", adjectives=["big"], case="acc"), ("the big cat", "die große Katze")),
    (dict(noun="cat", adjectives=["big"], case="dat"), ("the big cat", "der großen Katze")),
    (dict(noun="man", adjectives=["old"], det="a"), ("an old man", "ein alter Mann")),
    (dict(noun="man", adjectives=["old"], det="a", case="acc"), ("an old man", "einen alten Mann")),
    (dict(noun="house", adjectives=["new"], det="a"), ("a new house", "ein neues Haus")),
    (dict(noun="woman", det="a", case="dat"), ("a woman", "einer Frau")),
    (dict(noun="child", det="the", plural=True, case="dat"), ("the children", "den Kindern")),
    (dict(noun="dog", adjectives=["small"], det="two", plural=True), ("two small dogs",
                                                                       "zwei kleine Hunde")),
    (dict(noun="dog", adjectives=["small"], det="a", plural=True, case="dat"),
     ("small dogs", "kleinen Hunden")),
    (dict(noun="book", adjectives=["red"], det="my", plural=True), ("my red books",
                                                                     "meine roten Bücher")),
    (dict(noun="car", adjectives=["expensive"], det="our"), ("our expensive car",
                                                             "unser teurer Wagen")),
    (dict(noun="tree", adjectives=["high"], det="this", case="dat"), ("this high tree",
                                                                      "diesem hohen Baum")),
    (dict(noun="street", adjectives=["dark"], det="this", plural=True),
     ("these dark streets", "diese dunklen Straßen")),
    (dict(noun="girl", adjectives=["small"], very=True), ("the very small girl",
                                                          "das sehr kleine Mädchen")),
])
def test_noun_phrase_agreement(args, expected):
    assert noun_phrase(**args) == expected


@pytest.mark.parametrize(("args", "expected"), [
    (("in", "garden"), ("in the garden", "im Garten")),
    (("into", "garden"), ("into the garden", "in den Garten")),
    (("into", "house"), ("into the house", "ins Haus")),
    (("to", "school"), ("to the school", "zur Schule")),
    (("to", "doctor"), ("to the doctor", "zum Arzt")),
    (("at", "window"), ("at the window", "am Fenster")),
    (("in", "city", False, "a"), ("in a city", "in einer Stadt")),
    (("with", "child", True), ("with the children", "mit den Kindern")),
    (("for", "friend", False, "my"), ("for my friend", "für meinen Freund")),
    (("under", "table", False, "the", ["old"]), ("under the old table", "unter dem alten Tisch")),
    (("in front of", "house"), ("in front of the house", "vor dem Haus")),
    (("through", "forest", False, "this"), ("through this forest", "durch diesen Wald")),
])
def test_prepositions_govern_case_and_contract(args, expected):
    assert prepositional_phrase(*args) == expected


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    (("dog", "see", "cat"), {}, ("the dog sees the cat", "der Hund sieht die Katze")),
    (("dog", "see", "cat"), {"mode": "sub"}, ("the dog sees the cat", "der Hund die Katze sieht")),
    (("dog", "see", "cat"), {"tense": "past"},
     ("the dog saw the cat", "der Hund hat die Katze gesehen")),
    (("dog", "see", "cat"), {"tense": "past", "mode": "sub"},
     ("the dog saw the cat", "der Hund die Katze gesehen hat")),
    (("man", "read", "book"), {"time": "today", "front": True},
     ("today the man reads the book", "heute liest der Mann das Buch")),
    (("man", "read", "book"), {"time": "today"},
     ("the man reads the book today", "der Mann liest heute das Buch")),
    (("man", "call", "woman"), {}, ("the man calls the woman", "der Mann ruft die Frau an")),
    (("man", "call", "woman"), {"mode": "sub"},
     ("the man calls the woman", "der Mann die Frau anruft")),
    (("man", "call", "woman"), {"tense": "can"},
     ("the man can call the woman", "der Mann kann die Frau anrufen")),
    (("we", "help", "teacher"), {}, ("we help the teacher", "wir helfen dem Lehrer")),
    (("you", "help", "teacher"), {}, ("you help the teacher", "du hilfst dem Lehrer")),
    (("I", "help", "teacher"), {"tense": "fut"},
     ("I will help the teacher", "ich werde dem Lehrer helfen")),
    (("they", "run"), {"tense": "past"}, ("they ran", "sie sind gelaufen")),
    (("she", "run"), {"tense": "want", "mode": "sub"}, ("she wants to run", "sie laufen will")),
    (("he", "work"), {}, ("he works", "er arbeitet")),
    (("I", "know"), {}, ("I know", "ich weiß")),
    (("cat", "be"), {"tense": "past"}, ("the cat was", "die Katze war")),
])
def test_clause_word_order_and_conjugation(args, kwargs, expected):
    assert clause(*args, **kwargs) == expected


def test_subordinate_and_relative_clauses_put_the_finite_verb_last(pairs):
    finite = finite_forms()
    assert {"sieht", "anruft", "hat", "weiß", "sind"} <= finite
    checked = {"weil": 0, "rel": 0}
    for _, de in pairs:
        chunks = [c.split() for c in de.rstrip(".").split(", ")]
        for i, chunk in enumerate(chunks):
            # German sets commas only around clauses, so a comma after a noun opens a
            # relative clause, whose pronoun agrees with that noun.
            relative = i > 0 and chunk[0] in RELATIVE_PRONOUNS and chunks[i - 1][-1][0].isupper()
            if not (relative or chunk[0].lower() in SUBORDINATORS):
                continue
            # A clause that goes on with a relative clause of its own ends in a noun here.
            nested = i + 1 < len(chunks) and chunks[i + 1][0] in RELATIVE_PRONOUNS \
                and chunk[-1][0].isupper()
            if not nested:
                assert chunk[-1] in finite, (chunk, de)
                checked["rel" if relative else chunk[0].lower()] = \
                    checked.get("rel" if relative else chunk[0].lower(), 0) + 1
    assert checked["weil"] > 100 and checked["rel"] > 100 and checked["dass"] > 50


def test_because_clauses_move_the_verb_to_the_end(pairs):
    """English keeps subject-verb-object after "because"; German puts the verb last."""
    finite = finite_forms()
    english_verbs = {w for verbs in toy._VERBS.values() for v in verbs
                     for form in (*v.en_pres, *v.en_past) for w in form}
    moved = 0
    for en, de in pairs:
        if de.count(",") != 1 or ", weil " not in de or en.count(" because ") != 1:
            continue
        en_clause = en.rstrip(".").split(" because ")[1].split()
        de_clause = de.rstrip(".").split(", weil ")[1].split()
        assert de_clause[-1] in finite, de
        moved += en_clause[-1] not in english_verbs
    assert moved > 100


def test_fronted_adverb_inverts_subject_and_verb(pairs):
    finite = finite_forms()
    fronted = [(en, de) for en, de in pairs if words(de)[0] in ("Heute", "Gestern", "Morgen")]
    assert len(fronted) > 30
    for en, de in fronted:
        assert words(en)[0] in ("Today", "Yesterday", "Tomorrow")
        assert words(de)[1] in finite, de


def test_fronted_subordinate_clause_makes_main_clause_verb_first(pairs):
    finite = finite_forms()
    found = 0
    for _, de in pairs:
        chunks = de.split(", ")
        if chunks[0].split()[0] in ("Wenn", "Als", "Obwohl", "Weil") and len(chunks) == 2:
            assert chunks[1].split()[0] in finite, de
            found += 1
    assert found > 50


def test_als_for_past_when_wenn_otherwise(pairs):
    verbs = [v for vs in toy._VERBS.values() for v in vs]
    present = {w for v in verbs for form in (*v.en_pres, v.en_base) for w in form}
    past_forms = {w for v in verbs for form in v.en_past for w in form} - present
    assert {"saw", "was", "were", "gave"} <= past_forms and "read" not in past_forms
    als = 0
    for en, de in pairs:
        if en.startswith("When ") and de.count(",") == 1:  # one plain clause, then the main one
            first = en.split(",")[0].split()
            if past_forms & set(first):
                assert de.startswith("Als "), (en, de)
                als += 1
            if de.startswith("Als "):
                assert not {"will", "can", "must", "wants", "want"} & set(first), (en, de)
            else:
                assert de.startswith("Wenn "), (en, de)
    assert als >= 5
