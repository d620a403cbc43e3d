#!/usr/bin/env python3
"""Mutation check of the reference comparisons: each case breaks one reference cell (NaN, a
drift of 10x the test's bound, a missing cell), runs the test that compares it, and records
whether it failed (it must), then restores the file with git checkout (#55).

Usage: python3 tests/golden/mutation_check.py [CASE ...]  (numpy needed; the real models in
ATTNSCOPE_CACHE; a case is an index into C). Prints one markdown row per case."""
import json, subprocess, sys, os, re, numpy as np
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))); G = root + '/tests/golden/'
env = dict(os.environ)

def npy(path, kind, idx, delta=None):
    a = np.load(G + path)
    f = a.reshape(-1)
    if kind == 'nan': f[idx] = np.nan
    else: f[idx] += delta
    np.save(G + path, a)

def walk(obj, keypath):
    for k in keypath: obj = obj[k]
    return obj

def js(path, keypath, kind, delta=None):
    d = json.load(open(G + path))
    parent = walk(d, keypath[:-1]); k = keypath[-1]
    if kind == 'drift': parent[k] = parent[k] + delta
    elif kind == 'missing':
        if isinstance(parent, list): parent.pop(k)
        else: del parent[k]
    json.dump(d, open(G + path, 'w'))

def find_num(d, pred=lambda p: True, path=()):
    """first numeric leaf (not bool) whose path satisfies pred"""
    if isinstance(d, dict):
        for k, v in d.items():
            r = find_num(v, pred, path + (k,))
            if r: return r
    elif isinstance(d, list):
        for i, v in enumerate(d):
            r = find_num(v, pred, path + (i,))
            if r: return r
    elif isinstance(d, (int, float)) and not isinstance(d, bool) and pred(path) and abs(d) > 1e-3:
        return path
    return None

def run(name, mutate, binary, filt, files):
    mutate()
    r = subprocess.run(['cargo', 'test', '--release', '-q', '--test', binary, filt, '--', '--nocapture'],
                       cwd=root, env=env, capture_output=True, text=True)
    subprocess.run(['git', 'checkout', '--'] + ['tests/golden/' + f for f in files], cwd=root)
    out = r.stdout + r.stderr
    ran = sum(int(x) for x in re.findall(r'(\d+) passed', out)) + sum(int(x) for x in re.findall(r'(\d+) failed', out))
    fails = re.findall(r'panicked at [^\n]*\n([^\n]*)', out)
    caught = r.returncode != 0
    msg = fails[0][:220] if fails else ''
    print(f"| {name} | `{binary}` {filt} | {'caught' if caught else 'NOT CAUGHT'} (tests run {ran}) | {msg} |", flush=True)

cases = []
C = [
 ("qwen attention, one cell NaN", lambda: npy('qwen_transformers_attn_full.npy','nan',1234), 'real_models','qwen_matches_transformers',['qwen_transformers_attn_full.npy']),
 ("qwen attention, one cell +1e-3 (10x 1e-4)", lambda: npy('qwen_transformers_attn_full.npy','drift',1234,1e-3), 'real_models','qwen_matches_transformers',['qwen_transformers_attn_full.npy']),
 ("llama3 fixture attention, one cell NaN", lambda: npy('arch/llama3/attn_short.npy','nan',77), 'arch_fixtures','llama3',['arch/llama3/attn_short.npy']),
 ("llama3 fixture attention, +2e-4 (10x 2e-5)", lambda: npy('arch/llama3/attn_short.npy','drift',77,2e-4), 'arch_fixtures','llama3',['arch/llama3/attn_short.npy']),
 ("minilm attention, one cell NaN", lambda: npy('minilm_encoder_attn_lesson.npy','nan',500), 'encoder','minilm_matches_transformers_on_texts_and_a_pair',['minilm_encoder_attn_lesson.npy']),
 ("dla (SmolLM2): layer 3's head list loses its last head", lambda: js('smol_ref_interventions.json',('dla','lesson','logit','heads',3,-1),'missing'), 'ref_interventions','dla_matches_transformers_smollm',['smol_ref_interventions.json']),
 ("dla (SmolLM2): one head +1e-3 (10x 1e-4)", lambda: js('smol_ref_interventions.json',('dla','lesson','diff','heads',5,2),'drift',1e-3), 'ref_interventions','dla_matches_transformers_smollm',['smol_ref_interventions.json']),
 ("attribution patching (SmolLM2): hook_z layer 29 loses a head", lambda: js('smol_attrpatch.json',('hook_z',29,-1),'missing'), 'attrpatch','attribution_patching_matches_torch_smollm',['smol_attrpatch.json']),
 ("IG (qwen, f64 golden): one token +5e-2 of max", lambda: js('qwen_ig_f64.json', find_num(json.load(open(G+'qwen_ig_f64.json')), lambda p: 'ig' in str(p)), 'drift', 0.5), 'gradients','qwen_against_autograd',['qwen_ig_f64.json']),
 ("gradients (qwen): grad_input_l2 token 3 +10%", lambda: js('qwen_gradients.json',('texts','lesson','grad_input_l2',3),'drift',0.1*json.load(open(G+'qwen_gradients.json'))['texts']['lesson']['grad_input_l2'][3]), 'gradients','qwen_against_autograd',['qwen_gradients.json']),
 ("ALTI rows (SmolLM2): last layer loses a key", lambda: js('mixing/smol.json',('alti_last_rows',29,-1),'missing'), 'mixing','smol_against_torch_and_lxt',['mixing/smol.json']),
 ("value zeroing (SmolLM2): one cell +2e-4 (10x 2e-5)", lambda: js('mixing/smol.json',('value_zeroing_last_rows',10,5),'drift',2e-4), 'mixing','smol_against_torch_and_lxt',['mixing/smol.json']),
 ("generate (SmolLM2): a token's log p +1e-3 (10x 1e-4)", lambda: js('smol_generate.json',('cases','raw_lesson','logprobs',2),'drift',1e-3), 'generate','smol_greedy_generation_equals_transformers',['smol_generate.json']),
 ("compare JS (qwen): one layer +5e-4 (10x 5e-5)", lambda: js('compare_ref.json',('models','qwen2.5-coder-0.5b','js',3),'drift',5e-4) if not isinstance(json.load(open(G+'compare_ref.json'))['models']['qwen2.5-coder-0.5b']['js'][3],list) else js('compare_ref.json',('models','qwen2.5-coder-0.5b','js',3,0),'drift',5e-4), 'ref_analyses','compare_two_texts_on_the_default_model_against_transformers',['compare_ref.json']),
 ("qk (SmolLM2): a row score +1e-2", lambda: js('qk_circuits.json',('smol','qk',0,'row_scores',1),'drift',1e-2), 'qk','',['qk_circuits.json']),
]
only = sys.argv[1:] and [int(x) for x in sys.argv[1:]]
for i, c in enumerate(C):
    if only and i not in only: continue
    run(*c)
