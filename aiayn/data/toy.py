"""A deterministic synthetic English→German translation task with real grammar.

`generate_pairs` draws sentences from a small recursive grammar and renders every parse
twice, once by English rules and once by German rules, from a fixed lexicon of 75 nouns,
60 verbs, 40 adjectives, adverbs, numbers, prepositions and names. A substitution
cipher would be learnt word by word; this task is not one. To score well a model must learn:

* case and gender/number agreement: articles, ``dieser``, possessives and adjective endings
  (weak after der-words, mixed after ein-words, strong without an article) depend on the
  noun's gender (m/f/n), its number and its case: nominative for subjects, accusative for
  direct objects and after für/ohne/durch/um and directional in/auf ("into the garden" →
  "in den Garten"), dative for indirect objects, after helfen/folgen/danken, after
  mit/zu/aus and locative in/auf/unter/... ("in the garden" → "im Garten"); dative plural
  nouns add -n ("mit den Kindern"); predicative adjectives stay uninflected ("ist klein");
  relative pronouns agree in gender and number and take the case of their role
  ("der Hund, den die Katze sieht", "die Kinder, denen der Mann hilft");
* contractions of preposition and article (im, ins, am, zum, zur, vom) and "a"/"an";
* verb agreement with the subject (ich/du/er/wir/sie), vowel changes (sieht, läuft), the
  present, past, future and can/must/want; English simple past becomes the German perfect
  with haben or sein ("the dog ran" → "der Hund ist gelaufen");
* word order: V2 (the finite verb second, after a fronted time adverb it precedes the
  subject: "today the man reads a book" → "heute liest der Mann ein Buch"), verb-first
  after a fronted subordinate clause ("Wenn der Hund schläft, spielt die Katze."), the
  right bracket (participles, infinitives after modals/werden, separable prefixes such as
  "ruft ... an" go to the end), verb-final subordinate and relative clauses ("weil der Hund
  die Katze gesehen hat"), time adverbs moved from the English clause end to the German
  middle field, and dative-before-accusative for "gives a book to the child";
* lexical choices that need context: "when" → als (past) or wenn, commas that German
  requires around subordinate and relative clauses where English has none.

Grammar (weights in the code): sentence = [fronted subordinate clause ","] main clause
{connector clause}; connectors are and/but (main clause) or because/although/when/while
(subordinate clause). A clause is subject + verb (intransitive, motion, transitive, dative,
ditransitive, saying + "that"-clause, or copula + adjective/place) + objects, prepositional
phrases and adverbs. A noun phrase may carry adjectives, a prepositional phrase or a
relative clause, so clauses nest (two levels at most).

Words are whitespace-separated; commas and the final period stay attached to the preceding
word, so they never count as words. A sentence grows clause by clause until both sides
have min_words, and is drawn again (never truncated) if either side exceeds max_words.
With the defaults the mean is 12.9 words, the median 11, the 10th/90th/99th percentiles
5/25/36: many short sentences and a long tail, like a real corpus. Semantics is not
modelled beyond animate subjects and a few object classes per verb ("the hungry house"),
since the task is the grammar, not the world.

Speed: 40k-60k pairs/s with the defaults (50k pairs in about 1 s) on one core of an AMD
EPYC VM with CPython 3.11; narrow length windows such as (40, 40) resample and are slower.
`noun_phrase`, `prepositional_phrase` and `clause` render one given parse through the same
code, for tests and for the curious.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

# --------------------------------------------------------------------------- lexicon

M, F, N, PL = 0, 1, 2, 3  # gender, or plural: the column of every declension table
NOM, ACC, DAT = 0, 1, 2
_CASES = {"nom": NOM, "acc": ACC, "dat": DAT}
_GENDERS = {"m": M, "f": F, "n": N}

# Class a: animate (may be a subject); p: place; t: thing.
_NOUN_TEXT = """
a m dog dogs Hund Hunde; m man men Mann Männer; m teacher teachers Lehrer Lehrer
a m father fathers Vater Väter; m brother brothers Bruder Brüder; m friend friends Freund Freunde
a m doctor doctors Arzt Ärzte; m cook cooks Koch Köche; m king kings König Könige
a m bird birds Vogel Vögel; m frog frogs Frosch Frösche; m baker bakers Bäcker Bäcker
a f woman women Frau Frauen; f cat cats Katze Katzen; f mother mothers Mutter Mütter
a f sister sisters Schwester Schwestern; f mouse mice Maus Mäuse; f cow cows Kuh Kühe
a f grandmother grandmothers Großmutter Großmütter; f duck ducks Ente Enten
a n child children Kind Kinder; n girl girls Mädchen Mädchen; n horse horses Pferd Pferde
a n lamb lambs Lamm Lämmer; n pig pigs Schwein Schweine; n baby babies Baby Babys
p m garden gardens Garten Gärten; m park parks Park Parks; m forest forests Wald Wälder
p m river rivers Fluss Flüsse; m lake lakes See Seen; m train trains Zug Züge
p m car cars Wagen Wagen; f city cities Stadt Städte; f street streets Straße Straßen
p f school schools Schule Schulen; f church churches Kirche Kirchen; f kitchen kitchens Küche Küchen
p f bridge bridges Brücke Brücken; n house houses Haus Häuser; n village villages Dorf Dörfer
p n room rooms Zimmer Zimmer; n boat boats Boot Boote; n hotel hotels Hotel Hotels
p n bed beds Bett Betten
t m table tables Tisch Tische; m chair chairs Stuhl Stühle; m tree trees Baum Bäume
t m apple apples Apfel Äpfel; m letter letters Brief Briefe; m key keys Schlüssel Schlüssel
t m coat coats Mantel Mäntel; m hat hats Hut Hüte; m ball balls Ball Bälle
t m cake cakes Kuchen Kuchen; m stone stones Stein Steine; f door doors Tür Türen
t f lamp lamps Lampe Lampen; f flower flowers Blume Blumen; f bottle bottles Flasche Flaschen
t f cup cups Tasse Tassen; f bag bags Tasche Taschen; f story stories Geschichte Geschichten
t f newspaper newspapers Zeitung Zeitungen; f box boxes Kiste Kisten; f pear pears Birne Birnen
t n book books Buch Bücher; n window windows Fenster Fenster; n egg eggs Ei Eier
t n picture pictures Bild Bilder; n glass glasses Glas Gläser; n song songs Lied Lieder
t n gift gifts Geschenk Geschenke; n bicycle bicycles Fahrrad Fahrräder; n shirt shirts Hemd Hemden
"""

# Kinds: I intransitive, M motion, T accusative object, D dative object, G dative +
# accusative, S saying (+ that-clause). Fields: English base and past ("_" joins words),
# German infinitive ("|" marks a separable prefix), 3rd singular ("-": regular, or
# "1sg/2sg/3sg"), participle, perfect auxiliary (h: haben, s: sein), and optionally the
# noun classes of the object (default: any), so that one reads books rather than dogs.
_VERB_TEXT = """
I sleep slept schlafen schläft geschlafen h; I laugh laughed lachen - gelacht h
I sing sang singen - gesungen h; I wait waited warten - gewartet h
I work worked arbeiten - gearbeitet h; I dance danced tanzen - getanzt h
I play played spielen - gespielt h; I cry cried weinen - geweint h
I live lived wohnen - gewohnt h; I sit sat sitzen - gesessen h; I stand stood stehen - gestanden h
M run ran laufen läuft gelaufen s; M come came kommen - gekommen s; M go went gehen - gegangen s
M swim swam schwimmen - geschwommen s; M drive drove fahren fährt gefahren s
M travel travelled reisen - gereist s; M fly flew fliegen - geflogen s
M jump jumped springen - gesprungen s; M climb climbed klettern - geklettert s
T see saw sehen sieht gesehen h; T read read lesen liest gelesen h t
T eat ate essen isst gegessen h t; T buy bought kaufen - gekauft h t
T find found finden - gefunden h; T carry carried tragen trägt getragen h at
T paint painted malen - gemalt h; T open opened öffnen - geöffnet h t
T love loved lieben - geliebt h a; T visit visited besuchen - besucht h ap
T hear heard hören - gehört h a; T take took nehmen nimmt genommen h t
T wash washed waschen wäscht gewaschen h at; T catch caught fangen fängt gefangen h a
T drink drank trinken - getrunken h t; T write wrote schreiben - geschrieben h t
T build built bauen - gebaut h t; T hold held halten hält gehalten h at
T sell sold verkaufen - verkauft h t; T forget forgot vergessen vergisst vergessen h t
T need needed brauchen - gebraucht h; T call called an|rufen - angerufen h a
T invite invited ein|laden lädt eingeladen h a; T look_for looked_for suchen - gesucht h
T describe described beschreiben - beschrieben h
D help helped helfen hilft geholfen h; D follow followed folgen - gefolgt s
D thank thanked danken - gedankt h; D answer answered antworten - geantwortet h
G give gave geben gibt gegeben h; G show showed zeigen - gezeigt h
G bring brought bringen - gebracht h
G send sent schicken - geschickt h; G tell told erzählen - erzählt h
S say said sagen - gesagt h; S know knew wissen weiß/weißt/weiß gewusst h
S believe believed glauben - geglaubt h; S hope hoped hoffen - gehofft h
"""

# ":" gives the stem that takes endings (teuer → der teure Wagen).
_ADJ_TEXT = """
small klein; big groß; old alt; young jung; new neu; red rot; blue blau; green grün; white weiß
black schwarz; beautiful schön; quiet ruhig; happy glücklich; sad traurig; tired müde; warm warm
friendly freundlich; brown braun; cold kalt; long lang; short kurz; heavy schwer; empty leer
full voll; dirty schmutzig; clean sauber; strange seltsam; famous berühmt; expensive teuer:teur
dark dunkel:dunkl; high hoch:hoh; hungry hungrig; clever klug; wild wild; brave mutig; loud laut
rich reich; poor arm; pretty hübsch; funny lustig
"""

_NAMES = "Anna Peter Maria Thomas Lisa Paul Sarah Max Julia Felix Emma Jonas Lukas Sophie".split()
_PRONOUNS = (("I", "ich", 0), ("you", "du", 1), ("he", "er", 2), ("she", "sie", 2),
             ("we", "wir", 3), ("they", "sie", 4))
_NUMBERS = tuple(zip("two three four five six seven eight nine ten eleven twelve".split(),
                     "zwei drei vier fünf sechs sieben acht neun zehn elf zwölf".split(),
                     strict=True))
# English determiner → (plural English, German stem, declension kind).
_DETS = {"the": ("the", "", "der"), "this": ("these", "dies", "dies"), "a": ("", "ein", "ein"),
         "my": ("my", "mein", "ein"), "your": ("your", "dein", "ein"),
         "his": ("his", "sein", "ein"), "her": ("her", "ihr", "ein"),
         "our": ("our", "unser", "ein")}
_DETS.update({en: (en, de, "num") for en, de in _NUMBERS})
_POSSESSIVES = ("my", "your", "his", "her", "our")

# Rows: case (nom, acc, dat); columns: masculine, feminine, neuter, plural.
_DEF = (("der", "die", "das", "die"), ("den", "die", "das", "die"), ("dem", "der", "dem", "den"))
_REL = (("der", "die", "das", "die"), ("den", "die", "das", "die"), ("dem", "der", "dem", "denen"))
_STRONG = (("er", "e", "es", "e"), ("en", "e", "es", "e"), ("em", "er", "em", "en"))  # = dieser
_EIN = (("", "e", "", "e"), ("en", "e", "", "e"), ("em", "er", "em", "en"))
_WEAK = (("e", "e", "e", "en"), ("en", "e", "e", "en"), ("en", "en", "en", "en"))
_MIXED = (("er", "e", "es", "en"), ("en", "e", "es", "en"), ("en", "en", "en", "en"))
_ADJ_ENDINGS = {"der": _WEAK, "dies": _WEAK, "ein": _MIXED, "num": _STRONG, "": _STRONG}
_CONTRACT = {("in", DAT, M): "im", ("in", DAT, N): "im", ("in", ACC, N): "ins",
             ("an", DAT, M): "am", ("an", DAT, N): "am", ("zu", DAT, M): "zum",
             ("zu", DAT, N): "zum", ("zu", DAT, F): "zur", ("von", DAT, M): "vom",
             ("von", DAT, N): "vom"}
# English preposition → (German, case, noun classes of its object).
_PREPS = {"in": ("in", DAT, "p"), "on": ("auf", DAT, "pt"), "under": ("unter", DAT, "pt"),
          "next_to": ("neben", DAT, "pt"), "behind": ("hinter", DAT, "pt"),
          "in_front_of": ("vor", DAT, "pt"), "at": ("an", DAT, "pt"), "with": ("mit", DAT, "at"),
          "for": ("für", ACC, "a"), "without": ("ohne", ACC, "at"), "into": ("in", ACC, "p"),
          "onto": ("auf", ACC, "pt"), "to": ("zu", DAT, "pa"), "through": ("durch", ACC, "p"),
          "around": ("um", ACC, "pt"), "from": ("aus", DAT, "p")}
_LOC = ("in", "on", "under", "next_to", "behind", "in_front_of", "at")
_VP_PREPS = _LOC + _LOC + ("with", "with", "for", "without")
_NP_PREPS = _LOC + ("with", "with")
_DIR_PREPS = ("into", "onto", "to", "to", "through", "around", "from")
_MANNER = (("quickly", "schnell"), ("slowly", "langsam"), ("quietly", "leise"),
           ("loudly", "laut"), ("happily", "fröhlich"), ("carefully", "vorsichtig"))
# Time adverb, its German, and the tenses it goes with (p present, d past, f future, m modal).
_TIME = (("today", "heute", "pdfm"), ("yesterday", "gestern", "d"), ("tomorrow", "morgen", "pfm"),
         ("now", "jetzt", "pm"), ("often", "oft", "pd"), ("sometimes", "manchmal", "pdm"),
         ("in_the_morning", "am Morgen", "pdf"), ("in_the_evening", "am Abend", "pdfm"),
         ("at_night", "in der Nacht", "pdfm"), ("later", "später", "fm"), ("soon", "bald", "fm"),
         ("again", "wieder", "pdfm"))
_TENSES = ("pres",) * 9 + ("past",) * 5 + ("fut",) * 2 + ("can", "must", "want")
_TENSE_CLASS = {"pres": "p", "past": "d", "fut": "f", "can": "m", "must": "m", "want": "m"}
_TIME_BY_TENSE = {t: tuple((e.split("_"), d.split()) for e, d, ok in _TIME if c in ok)
                  for t, c in _TENSE_CLASS.items()}
# Finite auxiliaries, by person: ich, du, er/sie/es, wir, sie (plural).
_FIN = {"have": ("habe", "hast", "hat", "haben", "haben"),
        "be": ("bin", "bist", "ist", "sind", "sind"),
        "fut": ("werde", "wirst", "wird", "werden", "werden"),
        "can": ("kann", "kannst", "kann", "können", "können"),
        "must": ("muss", "musst", "muss", "müssen", "müssen"),
        "want": ("will", "willst", "will", "wollen", "wollen")}
_KINDS = "IIIIMMMTTTTTTTTDDGGSSCC"  # verb kind weights of a free clause
_MAX_DEPTH = 2  # clause nesting: relative and that-clauses inside clauses


class _Verb:
    """All forms one clause may need; index 0..4 = ich, du, er/sie/es, wir, sie (plural)."""

    __slots__ = ("kind", "obj", "en_base", "en_pres", "en_past", "de_pres", "de_past", "de_part",
                 "de_inf", "prefix")

    def __init__(self, line: str) -> None:
        kind, en, en_past, de, third, part, aux, *obj = line.split()
        self.kind, self.de_part = kind, (part,)
        self.obj = obj[0] if obj else "a" if kind == "D" else "apt"
        base = en.split("_")
        w = base[0]
        if w.endswith(("s", "sh", "ch", "x", "o")):
            s3 = w + "es"
        elif w.endswith("y") and w[-2] not in "aeiou":
            s3 = w[:-1] + "ies"
        else:
            s3 = w + "s"
        self.en_base = base
        self.en_pres = [base, base, [s3, *base[1:]], base, base]
        self.en_past = [en_past.split("_")] * 5
        self.prefix, _, inf = de.rpartition("|")
        self.de_inf = self.prefix + inf
        stem = inf[:-2] if inf.endswith("en") else inf[:-1]
        if "/" in third:
            first, second, third = third.split("/")
        else:
            if third == "-":
                et = stem[-1] in "td" or (stem[-1] in "mn" and stem[-2] not in "aeiouhlmnr")
                third = stem + ("et" if et else "t")
            first, second = stem + "e", third if third[-2] in "sßzx" else third[:-1] + "st"
        self.de_pres = (first, second, third, inf, inf)
        self.de_past = _FIN["have" if aux == "h" else "be"]


def _copula() -> _Verb:
    v = _Verb("C be was sein ist - h")
    v.en_pres = [["am"], ["are"], ["is"], ["are"], ["are"]]
    v.en_past = [["was"], ["were"], ["was"], ["were"], ["were"]]
    v.de_pres, v.de_part = _FIN["be"], ()
    v.de_past = ("war", "warst", "war", "waren", "waren")  # the preterite, not "ist gewesen"
    return v


def _entries(text: str) -> list[str]:
    return [item.strip() for line in text.strip().splitlines() for item in line.split(";")]


_NOUNS: dict[str, tuple] = {}
_POOL: dict[str, list[tuple]] = {c: [] for c in "apt"}
for _line in _NOUN_TEXT.strip().splitlines():
    _cls, _rest = _line.split(" ", 1)
    for _item in _rest.split(";"):
        _g, _en, _enpl, _de, _depl = _item.split()
        _datpl = _depl if _depl.endswith(("n", "s")) else _depl + "n"
        _NOUNS[_en] = (_en, _enpl, _de, _depl, _datpl, _GENDERS[_g])
        _POOL[_cls].append(_NOUNS[_en])
for _c in ("pt", "at", "pa", "ap", "apt"):
    _POOL[_c] = [n for c in _c for n in _POOL[c]]
_VERBS: dict[str, list[_Verb]] = {k: [] for k in "IMTDGSC"}
_VERB_BY_EN: dict[str, _Verb] = {}
for _item in _entries(_VERB_TEXT) + ["copula"]:
    _v = _copula() if _item == "copula" else _Verb(_item)
    _VERBS[_v.kind].append(_v)
    _VERB_BY_EN[" ".join(_v.en_base)] = _v
_ADJS: list[tuple[str, str, str]] = []  # (English, German, the stem that takes endings)
for _item in _entries(_ADJ_TEXT):
    _en, _de = _item.split()
    _de, _, _stem = _de.partition(":")
    _ADJS.append((_en, _de, _stem or (_de[:-1] if _de.endswith("e") else _de)))
_ADJ_BY_EN = {a[0]: a for a in _ADJS}


# --------------------------------------------------------------------------- rendering


def _render_np(noun: tuple, plural: bool, det: str, adjs: Sequence[tuple], case: int,
               very: bool = False) -> tuple[list[str], list[str], int]:
    """English and German tokens of a noun phrase, and its gender/number column."""
    en_sg, en_pl, de_sg, de_pl, de_datpl, g = noun
    gn = PL if plural else g
    en_det, stem, kind = _DETS[det]
    if not plural:
        en_det = det
    elif det == "a":  # "a" in the plural: no article at all ("small dogs", "kleine Hunde")
        kind = ""
    en = [a[0] for a in adjs] + [en_pl if plural else en_sg]
    de = [a[2] + _ADJ_ENDINGS[kind][case][gn] for a in adjs]
    if very and adjs:
        en.insert(0, "very")
        de.insert(0, "sehr")
    if en_det:
        en.insert(0, "an" if en_det == "a" and en[0][0] in "aeiou" else en_det)
    de.append(de_datpl if plural and case == DAT else de_pl if plural else de_sg)
    if kind == "der":
        de.insert(0, _DEF[case][gn])
    elif kind == "dies":
        de.insert(0, "dies" + _STRONG[case][gn])
    elif kind == "ein":
        de.insert(0, stem + _EIN[case][gn])
    elif kind == "num":
        de.insert(0, stem)
    return en, de, gn


def _render_pp(prep: str, en_np: list[str], de_np: list[str], det: str,
               gn: int) -> tuple[list[str], list[str]]:
    de_prep, case, _ = _PREPS[prep]
    short = _CONTRACT.get((de_prep, case, gn)) if det == "the" else None
    if short:
        return prep.split("_") + en_np, [short] + de_np[1:]
    return prep.split("_") + en_np, [de_prep] + de_np


def _verb_parts(v: _Verb, tense: str, person: int, sub: bool) -> tuple[list, str, list]:
    """English verb tokens, German finite verb, German right-bracket tokens."""
    if tense == "pres":
        en, fin, rest = v.en_pres[person], v.de_pres[person], [v.prefix] if v.prefix else []
        if sub and rest:  # verb-final: the separable prefix rejoins its verb
            fin, rest = v.prefix + fin, []
    elif tense == "past":
        en, fin, rest = v.en_past[person], v.de_past[person], list(v.de_part)
    else:
        fin, rest = _FIN[tense][person], [v.de_inf]
        en = {"fut": ["will"], "can": ["can"], "must": ["must"]}.get(tense) or (
            ["wants", "to"] if person == 2 else ["want", "to"])
        en = en + v.en_base
    return en, fin, rest


def _assemble(mode: str, subj: tuple, v: _Verb, tense: str, comps: tuple, manner=None,
              time=None, front=False, tail=((), ()), prefix=((), ())) -> tuple[list, list]:
    """Order one clause. mode: main (V2), inv (verb first), sub (verb last)."""
    s_en, s_de, person = subj
    en_v, fin, rest = _verb_parts(v, tense, person, mode == "sub")
    mid = list(time[1]) if time and not front else []
    if manner:
        mid.append(manner[1])
    mid += comps[1]
    en = [*prefix[0], *s_en, *en_v]
    if manner:
        en.append(manner[0])
    en += comps[0]
    if time and front:
        en = time[0] + en
    elif time:
        en += time[0]
    en += tail[0]
    if mode == "sub":
        de = [*prefix[1], *s_de, *mid, *rest, fin]
    elif mode == "inv":
        de = [fin, *s_de, *mid, *rest]
    elif time and front:  # V2: the fronted adverb pushes the subject behind the verb
        de = [*time[1], fin, *s_de, *mid, *rest]
    else:
        de = [*s_de, fin, *mid, *rest]
    de += tail[1]
    return en, de


def noun_phrase(noun: str, case: str = "nom", plural: bool = False, det: str = "the",
                adjectives: Sequence[str] = (), very: bool = False) -> tuple[str, str]:
    """Render one noun phrase, e.g. ("small dog", acc) → ("the small dog", "den kleinen Hund")."""
    adjs = [_ADJ_BY_EN[a] for a in adjectives]
    en, de, _ = _render_np(_NOUNS[noun], plural, det, adjs, _CASES[case], very)
    return " ".join(en), " ".join(de)


def prepositional_phrase(prep: str, noun: str, plural: bool = False, det: str = "the",
                         adjectives: Sequence[str] = ()) -> tuple[str, str]:
    """Render one prepositional phrase, e.g. ("to", "school") → ("to the school", "zur Schule")."""
    adjs = [_ADJ_BY_EN[a] for a in adjectives]
    en, de, gn = _render_np(_NOUNS[noun], plural, det, adjs, _PREPS[prep.replace(" ", "_")][1])
    en, de = _render_pp(prep.replace(" ", "_"), en, de, det, gn)
    return " ".join(en), " ".join(de)


def clause(subject: str, verb: str, obj: str | None = None, tense: str = "pres",
           mode: str = "main", time: str | None = None, front: bool = False) -> tuple[str, str]:
    """Render a simple clause: a pronoun or a definite singular noun subject, a verb, and a
    definite singular object in the case the verb governs; e.g. ("dog", "see", "cat",
    mode="sub") → ("the dog sees the cat", "der Hund die Katze sieht")."""
    pron = {p[0]: p for p in _PRONOUNS}.get(subject)
    if pron:
        subj = ([pron[0]], [pron[1]], pron[2])
    else:
        subj = _render_np(_NOUNS[subject], False, "the", (), NOM)[:2] + (2,)
    v = _VERB_BY_EN[verb]
    comps: tuple = ([], [])
    if obj:
        comps = _render_np(_NOUNS[obj], False, "the", (), DAT if v.kind == "D" else ACC)[:2]
    t = next(((e.split("_"), d.split()) for e, d, _ in _TIME if e == time), None)
    en, de = _assemble(mode, subj, v, tense, comps, time=t, front=front)
    return " ".join(en), " ".join(de)


# --------------------------------------------------------------------------- sampling


class _Gen:
    """The grammar's random choices; one instance is one deterministic stream of pairs."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed).random  # random() alone: stable across Python versions

    def pick(self, seq: Sequence):
        return seq[int(self.r() * len(seq))]

    def np(self, classes: str, case: int, depth: int, allow_rel: bool = True):
        """(en, de, person, has_relative_clause, determiner, gender/number) of a random NP."""
        r = self.r
        if "a" in classes and r() < 0.1:
            name = self.pick(_NAMES)
            return [name], [name], 2, False, "", -1
        noun = self.pick(_POOL[classes])
        plural = r() < 0.3
        x = r()
        if plural:
            det = ("the" if x < .45 else "a" if x < .65 else self.pick(_NUMBERS)[0] if x < .85
                   else self.pick(_POSSESSIVES) if x < .95 else "this")
        else:
            det = "the" if x < .55 else "a" if x < .8 else self.pick(_POSSESSIVES) if x < .95 \
                else "this"
        x = r()
        adjs: list = [] if x < .62 else [self.pick(_ADJS)]
        if x > .92:
            second = self.pick(_ADJS)
            if second is not adjs[0]:
                adjs.append(second)
        en, de, gn = _render_np(noun, plural, det, adjs, case, r() < .08)
        person = 4 if plural else 2
        if depth >= _MAX_DEPTH:
            return en, de, person, False, det, gn
        x = r()
        if x < 0.07:  # a prepositional phrase on the noun: "the man with the hat"
            pen, pde = self.pp(self.pick(_NP_PREPS), _MAX_DEPTH)
            return en + pen, de + pde, person, False, det, gn
        if allow_rel and x < 0.14:  # a relative clause: its pronoun agrees with the noun
            if r() < 0.55:
                subj = (["that"], [_REL[NOM][gn]], person)
                ren, rde = self.clause("sub", depth + 1, subj=subj)
            else:
                ren, rde = self.clause("sub", depth + 1, gap=gn)
            return en + ren, de + [","] + rde + [","], person, True, det, gn
        return en, de, person, False, det, gn

    def pp(self, prep: str, depth: int) -> tuple[list, list]:
        _, case, classes = _PREPS[prep]
        en, de, _, _, det, gn = self.np(classes, case, depth, allow_rel=False)
        return _render_pp(prep, en, de, det, gn)

    def clause(self, mode: str, depth: int, tense: str | None = None, subj=None, gap=None):
        r, pick = self.r, self.pick
        tense = tense or pick(_TENSES)
        kind = pick("TTDG") if gap is not None else pick(_KINDS)
        if kind == "S" and depth >= _MAX_DEPTH:
            kind = "T"
        v = pick(_VERBS[kind])
        if subj is None:
            if r() < 0.2:
                en, de, p = pick(_PRONOUNS)
                subj = ([en], [de], p)
            else:
                subj = self.np("apt" if kind == "C" else "a", NOM, depth)[:3]
        n_pp = 0 if kind in "SC" else (r() < {"I": .35, "M": .55}.get(kind, .25)) + (r() < .1)
        last = n_pp == 0  # a relative clause only on the last phrase, so nothing follows it
        comps_en: list = []
        comps_de: list = []
        has_rel = False
        prefix: tuple = ((), ())
        if kind == "C":
            if r() < 0.6:
                adj = pick(_ADJS)
                comps_en, comps_de = [adj[0]], [adj[1]]
                if r() < 0.1:
                    comps_en, comps_de = ["very", adj[0]], ["sehr", adj[1]]
            else:
                n_pp = 1
        elif kind in "TD":
            case = DAT if kind == "D" else ACC
            if gap is not None:
                prefix = (["that"], [_REL[case][gap]])
            else:
                comps_en, comps_de, _, has_rel, _, _ = self.np(v.obj, case, depth, last)
        elif kind == "G":
            if gap is not None:  # the accusative is the gap: "the book that he gives to Anna"
                prefix = (["that"], [_REL[ACC][gap]])
                dat = self.np("a", DAT, depth, last)
                comps_en, comps_de, has_rel = ["to", *dat[0]], dat[1], dat[3]
            else:
                dat = self.np("a", DAT, depth, False)
                to = r() < 0.3  # "gives a book to the child": German keeps dative first
                acc = self.np("t", ACC, depth, last and not to)
                comps_en = acc[0] + ["to"] + dat[0] if to else dat[0] + acc[0]
                comps_de, has_rel = dat[1] + acc[1], acc[3]
        for i in range(n_pp):  # motion verbs take a direction, then maybe a place
            prep = pick(_DIR_PREPS if kind == "M" and i == 0 else _LOC if kind == "C"
                        else _VP_PREPS)
            pen, pde = self.pp(prep, depth)
            comps_en += pen
            comps_de += pde
        manner = pick(_MANNER) if kind in "IM" and r() < 0.2 else None
        time = pick(_TIME_BY_TENSE[tense]) if r() < 0.25 else None
        front = time is not None and mode == "main" and (has_rel or r() < 0.4)
        if time and has_rel and not front:
            time = None  # an adverb after the relative clause would be ambiguous in English
        tail: tuple = ((), ())
        if kind == "S":
            sen, sde = self.clause("sub", depth + 1)
            tail = ((["that"] if r() < 0.8 else []) + sen, [",", "dass", *sde, ","])
        return _assemble(mode, subj, v, tense, (comps_en, comps_de), manner, time, front,
                         tail, prefix)

    def sentence(self, min_words: int) -> tuple[list, list]:
        r, pick = self.r, self.pick
        en: list = []
        de: list = []
        mode = "main"
        if r() < 0.1:  # a fronted subordinate clause makes the main clause verb-first
            tense = pick(_TENSES)
            conj = pick(("when", "when", "if", "although", "while", "because"))
            sen, sde = self.clause("sub", 1, tense)
            en, de = [conj, *sen, ","], [_subordinator(conj, tense), *sde, ","]
            mode = "inv"
        sen, sde = self.clause(mode, 0)
        en += sen
        de += sde
        while r() < 0.3 or _count(en) < min_words or _count(de) < min_words:
            x = r()
            if x < 0.5:
                conj_en, conj_de = (["and"], ["und"]) if x < 0.35 else ([",", "but"], [",", "aber"])
                sen, sde = self.clause("main", 0)
                en += conj_en + sen
                de += conj_de + sde
            else:
                tense = pick(_TENSES)
                conj = pick(("because", "because", "although", "when", "while"))
                sen, sde = self.clause("sub", 1, tense)
                en += [conj, *sen]
                de += [",", _subordinator(conj, tense), *sde, ","]
        return en, de


def _subordinator(conj: str, tense: str) -> str:
    if conj == "when":
        return "als" if tense == "past" else "wenn"
    return {"if": "wenn", "although": "obwohl", "while": "während", "because": "weil"}[conj]


def _count(tokens: list[str]) -> int:
    return len(tokens) - tokens.count(",")


def _finish(tokens: list[str]) -> str:
    out: list[str] = []
    for t in tokens:
        if t != ",":
            out.append(t)
        elif out and not out[-1].endswith(","):
            out[-1] += ","
    s = " ".join(out).rstrip(",")
    return s[0].upper() + s[1:] + "."


def generate_pairs(n: int, seed: int, min_words: int = 3,
                   max_words: int = 40) -> Iterator[tuple[str, str]]:
    """Yield n (english, german) sentence pairs, deterministic for a given seed."""
    if min_words > max_words or max_words < 2:
        raise ValueError(f"no sentence has {min_words}..{max_words} words (the shortest has 2)")
    gen = _Gen(seed)
    for _ in range(n):
        for _attempt in range(100_000):
            en, de = gen.sentence(min_words)
            if _count(en) <= max_words and _count(de) <= max_words:
                yield _finish(en), _finish(de)
                break
        else:
            raise RuntimeError(f"found no pair with {min_words}..{max_words} words on both sides")
