#!/usr/bin/env python3
"""The import cycles among the files of one folder of src/ (#57's goal: none among analysis/'s
files nor among model/'s; render/ and commands/ likewise): each file is a module, an edge A -> B
where A names `crate::<folder>::B...` or `super::B...` outside its tests (a child's use of its own
parent, or a parent's of its child, is not an edge); prints the files, the edges and each group of
files that import each other in a circle (a strongly connected group of more than one).

    python3 tools/module_cycles.py src/analysis      # also src/model, src/render, src/commands
"""
import re, os, sys, itertools
root = sys.argv[1]  # e.g. src/analysis
base = root.split('/',1)[1].replace('/','::')  # analysis
files = {}
for dp, dn, fn in os.walk(root):
    for f in fn:
        if f.endswith('.rs'):
            p = os.path.join(dp, f)
            rel = os.path.relpath(p, root)[:-3]
            mod = rel.replace('/mod','').replace('/', '::')
            if mod == 'mod': mod = ''
            files[mod] = open(p).read()
mods = set(files)
def target(path):
    # longest module prefix
    parts = path.split('::')
    for i in range(len(parts), 0, -1):
        m = '::'.join(parts[:i])
        if m in mods: return m
    return None
edges = set()
for m, src in files.items():
    src = src.split('#[cfg(test)]')[0]
    for u in re.findall(r'crate::' + base + r'::([A-Za-z0-9_:]+)', src):
        t = target(u)
        if t is not None and t != m and t != '' and not (m.startswith(t + '::') or t.startswith(m + '::') and m):
            edges.add((m, t))
    # super:: references
    for u in re.findall(r'\bsuper::([A-Za-z0-9_:]+)', src):
        parent = m.rsplit('::',1)[0] if '::' in m else ''
        # if file is a mod.rs, super is its parent's parent
        t = target((parent + '::' + u) if parent else u)
        if t and t != m and not t.startswith(m + '::') and not m.startswith(t + '::'):
            edges.add((m, t))
# SCCs
import collections
g = collections.defaultdict(set)
for a, b in edges: g[a].add(b)
idx, low, st, on, sccs, c = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in g[v]:
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: sccs.append(sorted(comp))
for v in list(mods):
    if v not in idx: sc(v)
print(root, len(mods), 'files', len(edges), 'edges; cycles (strongly connected groups):', sccs)
