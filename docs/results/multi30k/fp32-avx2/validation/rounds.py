"""Per-round figures of a bench.train_throughput record, and the median ratio of two
contenders' tokens/s within blocks of rounds (ad hoc; kept beside the record it read).

    python rounds.py train_throughput_validate.json valid fast 16,33 > rounds.txt

The last argument: the first round of each new block (here: the rounds after the passes at
steps 100 and 200). "V" marks a round in which the first contender validated."""

import json
import statistics
import sys

record = json.load(open(sys.argv[1]))
runs, tokens = record["runs"], record["round_tokens"]["preset"]
a, b = sys.argv[2], sys.argv[3]
warmup, steps = record["info"]["warmup"], record["info"]["steps"]
rows = []
for r, (x, y) in enumerate(zip(runs[a], runs[b], strict=True)):
    first = warmup + steps * r + 1
    rows.append({"round": r, "first": first, "last": first + steps - 1,
                 "a": tokens[r] / x["wall"], "b": tokens[r] / y["wall"],
                 "ratio": y["wall"] / x["wall"],  # a's tokens/s over b's
                 "fa": x["faults"] / steps, "fb": y["faults"] / steps,
                 "ra": x.get("rss_mib") or 0, "rb": y.get("rss_mib") or 0,
                 "mark": "V" if "validation" in x else ""})
for w in rows:
    print(f"r{w['round']:2d} steps {w['first']:3d}-{w['last']:3d}  {a} {w['a']:5.0f}  "
          f"{b} {w['b']:5.0f}  {a}/{b} tok/s {w['ratio']:.3f}  faults/step {w['fa']:6.0f} "
          f"{w['fb']:6.0f}  rss {w['ra']:5.0f} {w['rb']:5.0f} {w['mark']}")
cuts = [int(c) for c in sys.argv[4].split(",")] if len(sys.argv) > 4 else []
edges = [0, *cuts, len(rows)]
for lo, hi in zip(edges, edges[1:], strict=False):
    block = rows[lo:hi]
    if block:
        med = statistics.median
        print(f"rounds {lo}-{hi - 1}: median {a}/{b} tok/s ratio "
              f"{med(w['ratio'] for w in block):.3f} (n={len(block)}), faults/step "
              f"{med(w['fa'] for w in block):.0f} vs {med(w['fb'] for w in block):.0f}")
