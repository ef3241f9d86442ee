"""Per-round figures of a bench.train_throughput record, and the median ratio of two
contenders' tokens/s within blocks of rounds (ad hoc; kept beside the record it read).

    python rounds.py train_throughput_validate.json valid fast 16,33 > rounds.txt

The last argument: the first round of each new block (here: the rounds after the passes at
steps 100 and 200). "V" marks a round in which the first contender validated."""
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
runs = d["runs"]; tok = d["round_tokens"]["preset"]
a, b = sys.argv[2], sys.argv[3]
w = d["info"]["warmup"]; n = d["info"]["steps"]
ratios = []
for r, (x, y) in enumerate(zip(runs[a], runs[b])):
    first, last = w + n * r + 1, w + n * r + n
    ratios.append((r, first, last, tok[r] / x["wall"], tok[r] / y["wall"], y["wall"] / x["wall"],
                   x["faults"] / n, y["faults"] / n, x.get("rss_mib"), y.get("rss_mib"), "V" if "validation" in x else ""))
for row in ratios:
    print("r%2d steps %3d-%3d  %s %5.0f  %s %5.0f  %s/%s tok/s %.3f  faults/step %6.0f %6.0f  rss %5.0f %5.0f %s" % (row[0], row[1], row[2], a, row[3], b, row[4], a, b, row[5], row[6], row[7], row[8] or 0, row[9] or 0, row[10]))
cuts = [int(c) for c in sys.argv[4].split(",")] if len(sys.argv) > 4 else []
edges = [0] + cuts + [len(ratios)]
for lo, hi in zip(edges, edges[1:]):
    sel = ratios[lo:hi]
    if sel:
        print(f"rounds {lo}-{hi-1}: median {a}/{b} tok/s ratio {st.median(r[5] for r in sel):.3f} (n={len(sel)}), faults/step {st.median(r[6] for r in sel):.0f} vs {st.median(r[7] for r in sel):.0f}")
