#!/usr/bin/env python3
"""The crate's public API as rustdoc documents it, one line per item: every public type,
function, trait, constant and module (from target/doc/tch_amp/all.html), and each type's
inherent methods, enum variants, public fields and trait methods. Run after `cargo doc --no-deps`.

    python3 scripts/public-api.py            # print the listing
    python3 scripts/public-api.py --check F  # exit 1 (with a diff) when F differs from it

`make lint` checks it against .ci/public-api.txt, so the surface cannot grow unnoticed: after an
intended change, regenerate the file with `make public-api`.
"""
import difflib
import html
import os
import re
import sys

DOC = os.path.join(os.path.dirname(__file__), '..', 'target', 'doc', 'tch_amp')
KINDS = {'struct': 'struct', 'enum': 'enum', 'trait': 'trait', 'fn': 'fn', 'type': 'type',
         'constant': 'const', 'macro': 'macro', 'static': 'static', 'derive': 'derive', 'attr': 'attr'}


def items():
    text = open(os.path.join(DOC, 'all.html'), encoding='utf-8').read()
    for href in sorted(set(re.findall(r'href="([^"#]+\.html)"', text))):
        name = os.path.basename(href)
        kind = name.split('.', 1)[0]
        if kind in KINDS:
            yield href, kind


def members(page, kind):
    text = open(os.path.join(DOC, page), encoding='utf-8').read()
    # Inherent items only: cut before the trait implementations rustdoc lists after them.
    for marker in ('id="trait-implementations"', 'id="synthetic-implementations"',
                   'id="blanket-implementations"', 'id="implementors"', 'id="foreign-impls"'):
        at = text.find(marker)
        if at >= 0:
            text = text[:at]
    out = []
    for prefix, label in (('method.', 'fn'), ('tymethod.', 'fn'), ('variant.', 'variant'),
                          ('structfield.', 'field'), ('associatedconstant.', 'const'),
                          ('associatedtype.', 'type')):
        for m in sorted(set(re.findall(r'id="' + re.escape(prefix) + r'([A-Za-z0-9_]+)"', text))):
            out.append((label, m))
    return out


def listing():
    lines = []
    for href, kind in items():
        path = 'tch_amp::' + '::'.join(href[:-5].split('/')[:-1] + [href[:-5].split('/')[-1].split('.', 1)[1]])
        path = path.replace('tch_amp::tch_amp::', 'tch_amp::')
        lines.append(f'{KINDS[kind]} {path}')
        if kind in ('struct', 'enum', 'trait'):
            for label, m in members(href, kind):
                lines.append(f'{label} {path}::{m}')
    return sorted(set(html.unescape(l) for l in lines))


def main():
    lines = listing()
    if len(sys.argv) == 3 and sys.argv[1] == '--check':
        want = open(sys.argv[2], encoding='utf-8').read().splitlines()
        if want != lines:
            sys.stdout.writelines(l + '\n' for l in difflib.unified_diff(want, lines, sys.argv[2], 'now', lineterm=''))
            print(f'public API changed: regenerate {sys.argv[2]} with `make public-api` if intended', file=sys.stderr)
            sys.exit(1)
        print(f'public API: {len(lines)} items, as in {sys.argv[2]}')
        return
    sys.stdout.writelines(l + '\n' for l in lines)


if __name__ == '__main__':
    main()
