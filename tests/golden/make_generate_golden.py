#!/usr/bin/env python
"""Copies <m>_generate.json from the team's reference folder and adds, per case, the sink profile of
each generated row (head-averaged weight on position 0, per layer, from <m>_generate_<case>_rows.npy:
row i is the query at rows_from_position + i, which produced generated token i + 1), so the large
rows files stay out of the repository. Usage: python make_generate_golden.py REF_DIR qwen smol"""
import json, os, sys
import numpy as np

ref = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
for m in sys.argv[2:]:
    d = json.load(open(os.path.join(ref, f"{m}_generate.json")))
    for name, c in d["cases"].items():
        rows = np.load(os.path.join(ref, f"{m}_generate_{name}_rows.npy"))  # G', L, H, n
        c["sink_rows"] = rows[:, :, :, 0].astype(np.float64).mean(2).tolist()
    json.dump(d, open(os.path.join(here, f"{m}_generate.json"), "w"), ensure_ascii=False)
    print(m, list(d["cases"]))
