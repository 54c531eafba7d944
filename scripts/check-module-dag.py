#!/usr/bin/env python3
"""Checks that the crate's module graph is a DAG: one node per source file under src/, an edge
for every `crate::a::b` or `super::x` path a file names (outside comments). Prints each cycle
with its edges and exits 1 when there is one. Run by `make lint`.

    python3 scripts/check-module-dag.py [SRC_DIR]
"""
import os, re, sys
root = sys.argv[1] if len(sys.argv) > 1 else 'src'
files = {}
for d, _, fs in os.walk(root):
    for f in fs:
        if f.endswith('.rs'):
            p = os.path.join(d, f)
            rel = os.path.relpath(p, root)[:-3]
            parts = rel.split('/')
            if parts[-1] in ('mod', 'lib'):
                parts = parts[:-1]
            files[tuple(parts)] = p
def resolve(path):
    # longest prefix that is a file module
    for n in range(len(path), -1, -1):
        if tuple(path[:n]) in files:
            return tuple(path[:n])
    return None
edges = {k: set() for k in files}
for mod, p in files.items():
    src = open(p).read()
    src = re.sub(r'//[^\n]*', '', src)
    # crate:: paths, including in use groups: crate::a::{b, c::d}
    for m in re.finditer(r'crate::((?:\w+::)*)(\{[^}]*\}|\w+)', src):
        base = [x for x in m.group(1).split('::') if x]
        tail = m.group(2)
        names = [t.strip().split('::') for t in tail.strip('{}').split(',')] if tail.startswith('{') else [[tail]]
        for nm in names:
            nm = [x for x in nm if x and x != 'self']
            t = resolve(base + nm)
            if t is not None and t != mod and t != ():
                edges[mod].add(t)
    is_modfile = p.endswith('mod.rs') or p.endswith('lib.rs')
    parent = list(mod) if is_modfile else list(mod[:-1])
    for m in re.finditer(r'\bsuper::((?:\w+::)*)(\{[^}]*\}|\w+)', src):
        base = list(mod[:-1]) + [x for x in m.group(1).split('::') if x]
        tail = m.group(2)
        names = [t.strip().split('::') for t in tail.strip('{}').split(',')] if tail.startswith('{') else [[tail]]
        for nm in names:
            t = resolve(base + [x for x in nm if x and x != 'self'])
            if t is not None and t != mod and t != ():
                edges[mod].add(t)
# parent module files depend on their children only via `mod` (not an import); ignore.
# Tarjan SCC
idx = {}; low = {}; st = []; on = set(); sccs = []; c = [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx:
            sc(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        sccs.append(comp)
for v in edges:
    if v not in idx: sc(v)
cyc = [s for s in sccs if len(s) > 1]
for s in cyc:
    print('cycle of', len(s), ':', ', '.join('/'.join(x) for x in sorted(s)))
    for a in sorted(s):
        print('   ', '/'.join(a), '->', ', '.join('/'.join(b) for b in sorted(edges[a] & set(s))))
if not cyc:
    print('module graph: no cycles among', len(files), 'files')
sys.exit(1 if cyc else 0)
