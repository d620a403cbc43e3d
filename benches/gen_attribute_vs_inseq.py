#!/usr/bin/env python
"""Attribution of a generated answer, side by side in one run: `attnscope generate --attribute
occlusion` (one forward per deleted token gives every answer token's cell, teacher-forced) against
inseq's occlusion on transformers (the same GGUF dequantized to float32, eager) for a ~50-token
prompt and a 40-token answer, the answer teacher-forced on both sides (inseq gets attnscope's greedy
answer as `generated_texts`). Only the attribution is timed (attnscope's `attribution.seconds`;
inseq's `model.attribute`), not loading or generating.

inseq is not a dependency: install it beside the reference Python without touching its torch, e.g.
  ~/.hfenv/bin/python -m pip install --target /tmp/inseqlib --no-deps inseq captum jaxtyping typeguard \
      matplotlib pillow pyparsing cycler python-dateutil kiwisolver fonttools treescope
Use: ~/.hfenv/bin/python benches/gen_attribute_vs_inseq.py [--inseq-path /tmp/inseqlib] [--model smollm2-135m] [--smoke]
Note: inseq's (Captum's) occlusion replaces a token's embedding by zeros; attnscope's deletes the
token (as `attribute --method occlusion`); each is one forward per occluded token and target.

`--smoke`: SmolLM2, an 8-token prompt and a 4-token answer (checks the script; without torch,
transformers and inseq it says so and times attnscope alone, its prompt cut by words). Ends with a
table: one row per side.
"""
import argparse
import json
import os
import subprocess
import sys
import time

from bench_util import models_dir, reference, table

STORY = ("The old library in the centre of Hanoi keeps maps of the city from every century. Visitors "
         "come to see how the lakes, the river and the streets of the old quarter changed, and the "
         "librarian tells them a story about each map before they leave.")


def args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="qwen2.5-coder-0.5b; smollm2-135m with --smoke")
    ap.add_argument("--bin", default="target/release/attnscope")
    ap.add_argument("--inseq-path", default="/tmp/inseqlib")
    ap.add_argument("--prompt-len", type=int, default=50)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="an 8-token prompt, a 4-token answer: checks the script")
    a = ap.parse_args()
    if a.smoke:
        a.prompt_len, a.new = 8, 4
    a.model = a.model or ("smollm2-135m" if a.smoke else "qwen2.5-coder-0.5b")
    return a


def imports(a):
    sys.path.insert(0, a.inseq_path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    import transformers
    import inseq
    return torch, transformers, inseq


def main():
    a = args()
    mods = reference(a.smoke, "inseq", lambda: imports(a))
    tok = None
    d, f = models_dir(), f"{a.model}.gguf"
    if mods:
        torch, transformers, inseq = mods
        torch.set_num_threads(a.threads)
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        prompt = tok.decode(tok(STORY, add_special_tokens=False)["input_ids"][: a.prompt_len])
    else:
        prompt = " ".join(STORY.split()[: max(1, a.prompt_len * 3 // 4)])

    # attnscope: generate greedily, then attribute the answer (the timing it reports is the attribution)
    out = subprocess.run([a.bin, "generate", "-m", a.model, "--text", prompt, "--max-new-tokens", str(a.new),
                          "--attribute", "occlusion", "--json"], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    at = r["attribution"]
    p_len, n_ans = len(at["prompt_tokens"]), len(at["answer_tokens"])
    ours = at["seconds"]
    print(f"attnscope: {p_len} prompt + {n_ans} answer tokens, occlusion {ours:.2f} s", file=sys.stderr, flush=True)
    rows = [{"side": "attnscope generate --attribute occlusion", "prompt_tokens": p_len, "answer_tokens": n_ans,
             "seconds": ours}]
    if mods:
        answer = tok.decode([t["id"] for t in r["generated"]])
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        im = inseq.load_model(model, "occlusion", tokenizer=tok)
        t0 = time.perf_counter()
        res = im.attribute(input_texts=prompt, generated_texts=prompt + answer, show_progress=False)
        theirs = time.perf_counter() - t0
        sa = res.sequence_attributions[0]
        print(json.dumps({
            "model": a.model, "prompt_tokens": p_len, "answer_tokens": n_ans,
            "inseq_target_tokens": len(sa.target) - len(sa.source) if sa.target is not None else None,
            "attnscope_occlusion_s": round(ours, 3), "inseq_occlusion_s": round(theirs, 3),
            "speedup": round(theirs / ours, 2), "threads": a.threads,
        }, indent=1))
        rows.append({"side": "inseq occlusion", "prompt_tokens": p_len, "answer_tokens": n_ans, "seconds": theirs,
                     "speedup": theirs / ours})
    table(["side", "prompt_tokens", "answer_tokens", "seconds", "speedup"], rows)


if __name__ == "__main__":
    main()
