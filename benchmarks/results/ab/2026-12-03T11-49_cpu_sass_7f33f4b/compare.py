#!/usr/bin/env python3
"""Per-function SASS comparison of two builds of the same CUDA object files.

Usage:
  compare.py --cuobjdump BIN --nvdisasm BIN --old DIR --new DIR --out DIR FILE.cu [FILE.cu ...]

DIR is the directory holding <FILE>.cu.o (CMakeFiles/_nvshmem_ext.dir/ffi of a CMake build tree).
For each object: `cuobjdump -xelf all` extracts the sm_90 cubin, `nvdisasm -c -hex -ndf` disassembles it
(call targets resolved from relocations, branch targets shown as labels). Per function (.text.<name>):
  * name: the per-translation-unit tag (e.g. d08f5e84_15_combine_send_cu_9a9b7f9b_5058, differing between builds;
    found from the mangled length prefix of _ZN<len>_INTERNAL_<tag> / <len>_GLOBAL__N__<tag>) is written TU and
    the length prefixes in front of it (and __nv_static_<len>__) are written N, so old and new names match;
    --rename pairs a function the commit renamed (applied to the old build's normalized names);
  * kernel = a function whose symbol carries STO_CUDA_ENTRY (the rest are device functions);
  * instruction text: address and hex-encoding comments dropped, whitespace collapsed, the same TU
    normalization on symbol operands, the function's own symbol written SELF (self-relative return addresses),
    and branch labels (.L_x_N, numbered per cubin) renamed to L<k>, k the order of the label's address within
    the function;
  * trailing NOP alignment padding is counted separately (n_pad) and left out of the compared sequence.
Compared: the normalized instruction sequences (difflib, autojunk off), and for text-identical functions
also the raw 128-bit encodings (which include the scheduling control bits and relative branch offsets).
Cross-check: the per-function instruction count from `cuobjdump -sass` must equal nvdisasm's.
Writes <out>/table.tsv, <out>/diffs/<file>__<func>.diff for non-identical functions, and prints the table.
"""
import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

TAG_LEN_RE = re.compile(r'(\d+)(_INTERNAL_|_GLOBAL__N__)')


def find_tags(text):
    """The per-translation-unit tags (e.g. d08f5e84_15_combine_send_cu_9a9b7f9b_5058): taken from the mangled
    length prefix of _ZN<len>_INTERNAL_<tag> / <len>_GLOBAL__N__<tag>, so a trailing number in the tag is not
    confused with the next length digits."""
    tags = set()
    for m in TAG_LEN_RE.finditer(text):
        n = int(m.group(1))
        body = text[m.start(2):m.start(2) + n]
        if len(body) == n:
            tag = body[len(m.group(2)):]
            if re.fullmatch(r'_?[0-9a-f]{8}_\d+_[A-Za-z0-9_]+_cu_[0-9a-f]{8}(_\d+)?', tag):
                tags.add(tag.lstrip('_'))
    return tags


def norm_name(s, tags):
    for tag in sorted(tags, key=len, reverse=True):
        t = re.escape(tag)
        s = re.sub(r'\d+(_INTERNAL_|_GLOBAL__N__)(_?)' + t, r'N\1\2TU', s)
        s = re.sub(r'__nv_static_\d+__' + t, '__nv_static_N__TU', s)
        s = s.replace(tag, 'TU')
    return s


INSN_RE = re.compile(r'^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$')
HEX2_RE = re.compile(r'^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$')
LABEL_DEF_RE = re.compile(r'^(\.L_x_\d+):\s*$')
LABEL_USE_RE = re.compile(r'\.L_x_\d+')
SECTION_RE = re.compile(r'^\.text\.(\S+):\s*$')
CUOBJ_FUNC_RE = re.compile(r'^\s*Function : (\S+)')
CUOBJ_INSN_RE = re.compile(r'^\s*/\*[0-9a-f]{4,}\*/\s+\S')


def demangle(raw, tags):
    n = raw
    m = re.match(r'__nv_static_\d+__.*?_(_Z.*)$', n)
    if m:
        n = m.group(1)
    try:
        out = subprocess.run(['c++filt'], input=n, capture_output=True, text=True).stdout.strip() or n
    except OSError:
        out = n
    for tag in sorted(tags, key=len, reverse=True):
        out = out.replace(tag, 'TU')
    return out


def disasm(cuobjdump, nvdisasm, obj):
    with tempfile.TemporaryDirectory() as td:
        subprocess.run([cuobjdump, '-xelf', 'all', os.path.abspath(obj)], cwd=td, check=True,
                       capture_output=True)
        cubins = sorted(f for f in os.listdir(td) if f.endswith('.cubin'))
        sm90 = [f for f in cubins if 'sm_90' in f]
        if len(sm90) != 1:
            sys.exit(f'{obj}: expected one sm_90 cubin, found {cubins}')
        text = subprocess.run([nvdisasm, '-c', '-hex', '-ndf', os.path.join(td, sm90[0])], check=True,
                              capture_output=True, text=True).stdout
    return text


def parse_nvdisasm(text):
    """-> ({norm_name: dict(raw_name, kernel, insns=[(addr, text, w1, w2)], labels={label: addr})}, tags)"""
    tags = find_tags(text)
    funcs = {}
    # kernels: `.other <name>,@"STO_CUDA_ENTRY ..."` (may precede the .text.<name>: line)
    entries = set(re.findall(r'^\s*\.other\s+([^,\s]+),@"STO_CUDA_ENTRY', text, re.M))
    cur = None
    pending_labels = []
    for line in text.splitlines():
        m = SECTION_RE.match(line)
        if m:
            raw = m.group(1)
            cur = dict(raw_name=raw, kernel=raw in entries, insns=[], labels={})
            funcs[norm_name(raw, tags)] = cur
            pending_labels = []
            continue
        if cur is None:
            continue
        m = LABEL_DEF_RE.match(line)
        if m:
            pending_labels.append(m.group(1))
            continue
        m = INSN_RE.match(line)
        if m:
            addr = int(m.group(1), 16)
            for lb in pending_labels:
                cur['labels'][lb] = addr
            pending_labels = []
            cur['insns'].append([addr, m.group(2).strip(), m.group(3), None])
            continue
        m = HEX2_RE.match(line)
        if m and cur['insns'] and cur['insns'][-1][3] is None:
            cur['insns'][-1][3] = m.group(1)
            continue
        if line.startswith('//----') or line.strip().startswith('.section'):
            # end of the function body; a label after the last instruction (function end) gets addr=end
            if cur and pending_labels:
                end = cur['insns'][-1][0] + 16 if cur['insns'] else 0
                for lb in pending_labels:
                    cur['labels'][lb] = end
                pending_labels = []
    if cur and pending_labels:
        end = cur['insns'][-1][0] + 16 if cur['insns'] else 0
        for lb in pending_labels:
            cur['labels'][lb] = end
    return funcs, tags


def normalize(func, tags):
    order = {lb: f'L{k}' for k, (lb, _) in enumerate(sorted(func['labels'].items(), key=lambda kv: (kv[1], kv[0])))}
    # several labels at one address: give them the same name
    by_addr = {}
    for lb, a in func['labels'].items():
        by_addr.setdefault(a, []).append(lb)
    for lbs in by_addr.values():
        first = min(order[lb] for lb in lbs)
        for lb in lbs:
            order[lb] = first
    # the function's own symbol (e.g. in self-relative return addresses: 32@lo((<self> + .L_x_N@srel))) is
    # written SELF, so that a function renamed by the commit compares with its old self
    self_name = norm_name(func['raw_name'], tags)
    out = []
    for _, txt, _, _ in func['insns']:
        t = re.sub(r'\s+', ' ', txt)
        t = LABEL_USE_RE.sub(lambda m: order.get(m.group(0), 'EXT'), t)
        t = norm_name(t, tags)
        if self_name:
            t = t.replace(self_name, 'SELF')
        out.append(t)
    # trailing alignment padding: NOPs at the end
    n = len(out)
    while n and out[n - 1] == 'NOP':
        n -= 1
    return out[:n], len(out) - n


REG_RE = re.compile(r'\b(U?R|U?P|B)\d+\b')


def anon_regs(seq):
    return [REG_RE.sub(lambda m: m.group(1), x) for x in seq]


def opcode(insn):
    toks = insn.split(' ')
    return toks[1] if toks[0].startswith('@') else toks[0]


def cuobjdump_counts(cuobjdump, obj, tags):
    text = subprocess.run([cuobjdump, '-sass', obj], check=True, capture_output=True, text=True).stdout
    counts, cur = {}, None
    for line in text.splitlines():
        m = CUOBJ_FUNC_RE.match(line)
        if m:
            cur = norm_name(m.group(1), tags)
            counts[cur] = 0
        elif cur and CUOBJ_INSN_RE.match(line):
            counts[cur] += 1
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--cuobjdump', required=True)
    ap.add_argument('--nvdisasm', required=True)
    ap.add_argument('--old', required=True)
    ap.add_argument('--new', required=True)
    ap.add_argument('--out', required=True)
    ap.add_argument('--rename', action='append', default=[], metavar='OLD_RE=NEW',
                    help='regex substitution applied to the old build\'s normalized mangled names, to pair a '
                         'function renamed by the commit with its new name (re.fullmatch, then expand)')
    ap.add_argument('files', nargs='+')
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, 'diffs'), exist_ok=True)
    rows = []
    problems = []
    tag_log = []
    for f in a.files:
        stem = os.path.basename(f)
        objs = {v: os.path.join(d, stem + '.o') for v, d in (('old', a.old), ('new', a.new))}
        parsed, xcheck, tags = {}, {}, {}
        for v, obj in objs.items():
            if not os.path.exists(obj):
                problems.append(f'{stem}: {v} object {obj} missing')
                parsed[v] = None
                continue
            parsed[v], tags[v] = parse_nvdisasm(disasm(a.cuobjdump, a.nvdisasm, obj))
            tag_log.append(f'{stem} {v}: TU tags {sorted(tags[v])}')
            if len(tags[v]) > 1:
                problems.append(f'{stem} {v}: expected at most one TU tag, found {sorted(tags[v])}')
            xcheck[v] = cuobjdump_counts(a.cuobjdump, obj, tags[v])
            for name, fn in parsed[v].items():
                c = xcheck[v].get(name)
                if c != len(fn['insns']):
                    problems.append(f'{stem} {v} {name}: nvdisasm {len(fn["insns"])} insns, cuobjdump {c}')
        if parsed['old'] is None or parsed['new'] is None:
            continue
        old, new = parsed['old'], parsed['new']
        renamed = {}
        for rule in a.rename:
            rx, rep = rule.split('=', 1)
            for k in list(old):
                m = re.fullmatch(rx, k)
                if m:
                    nk = m.expand(rep)
                    if nk in old and nk != k:
                        problems.append(f'{stem}: rename {k} -> {nk} collides')
                        continue
                    old[nk] = old.pop(k)
                    renamed[nk] = k
        names = list(old) + [n for n in new if n not in old]
        for name in names:
            fo, fn = old.get(name), new.get(name)
            kernel = (fo or fn)['kernel']
            vv = 'old' if fo is not None else 'new'
            dem = demangle((fo or fn)['raw_name'], tags[vv])
            if fo is None or fn is None:
                rows.append(dict(file=stem, kernel=kernel, name=name, dem=dem,
                                 n_old=len(normalize(fo, tags['old'])[0]) if fo else '-',
                                 n_new=len(normalize(fn, tags['new'])[0]) if fn else '-',
                                 pad_old=normalize(fo, tags['old'])[1] if fo else '-',
                                 pad_new=normalize(fn, tags['new'])[1] if fn else '-',
                                 same='only-' + ('old' if fn is None else 'new'), enc='-', rm='-', add='-',
                                 regdiff='-', opdelta='-'))
                continue
            so, po = normalize(fo, tags['old'])
            sn, pn = normalize(fn, tags['new'])
            same = so == sn
            enc = '-'
            rm = add = 0
            regdiff = opdelta = '-'
            if same:
                enc = 'yes' if [(i[2], i[3]) for i in fo['insns'][:len(so)]] == \
                               [(i[2], i[3]) for i in fn['insns'][:len(sn)]] else 'no'
            else:
                sm = difflib.SequenceMatcher(None, so, sn, autojunk=False)
                for tag, i1, i2, j1, j2 in sm.get_opcodes():
                    if tag != 'equal':
                        rm += i2 - i1
                        add += j2 - j1
                ro, rn = anon_regs(so), anon_regs(sn)
                sm2 = difflib.SequenceMatcher(None, ro, rn, autojunk=False)
                rrm = radd = 0
                for tag, i1, i2, j1, j2 in sm2.get_opcodes():
                    if tag != 'equal':
                        rrm += i2 - i1
                        radd += j2 - j1
                co, cn = Counter(map(opcode, so)), Counter(map(opcode, sn))
                delta = {k: cn[k] - co[k] for k in set(co) | set(cn) if cn[k] != co[k]}
                regdiff = f'-{rrm}/+{radd}'
                opdelta = ' '.join(f'{k}:{v:+d}' for k, v in sorted(delta.items()))
                safe = re.sub(r'[^A-Za-z0-9_]+', '_', dem)[:120]
                with open(os.path.join(a.out, 'diffs', f'{stem}__{safe}.diff'), 'w') as fh:
                    fh.write(f'# {stem} {name}\n# {dem}\n')
                    fh.write(f'# normalized diff: -{rm}/+{add}; with registers anonymized: {regdiff}; '
                             f'opcode count change (new-old): {opdelta}\n')
                    fh.write('# === diff with registers anonymized (R<n>/UR<n>/P<n>/UP<n>/B<n> -> R/UR/P/UP/B) ===\n')
                    fh.writelines(difflib.unified_diff([s + '\n' for s in ro], [s + '\n' for s in rn],
                                                       'old', 'new', n=3))
                    fh.write('# === full normalized diff ===\n')
                    fh.writelines(difflib.unified_diff([s + '\n' for s in so], [s + '\n' for s in sn],
                                                       'old', 'new', n=3))
            if name in renamed:
                dem = (demangle(fn['raw_name'], tags['new']) + '  [old name: ' +
                       demangle(fo['raw_name'], tags['old']) + ']')
            rows.append(dict(file=stem, kernel=kernel, name=name, dem=dem, n_old=len(so), n_new=len(sn),
                             pad_old=po, pad_new=pn, same='yes' if same else 'no', enc=enc, rm=rm, add=add,
                             regdiff=regdiff, opdelta=opdelta))
    hdr = ['file', 'kind', 'function (demangled)', 'insns_old', 'insns_new', 'pad_old', 'pad_new',
           'identical', 'encoding_identical', 'removed(old)', 'added(new)', 'diff_regs_anonymized',
           'opcode_count_change', 'mangled (hashes normalized)']
    with open(os.path.join(a.out, 'table.tsv'), 'w') as fh:
        fh.write('\t'.join(hdr) + '\n')
        for r in rows:
            fh.write('\t'.join(str(x) for x in (r['file'], 'kernel' if r['kernel'] else 'device-fn', r['dem'],
                                                  r['n_old'], r['n_new'], r['pad_old'], r['pad_new'], r['same'],
                                                  r['enc'], r['rm'], r['add'], r['regdiff'], r['opdelta'],
                                                  r['name'])) + '\n')
    for r in rows:
        print(f"{r['file']:20} {'K' if r['kernel'] else 'f'} {r['n_old']!s:>6} {r['n_new']!s:>6} "
              f"same={r['same']:3} enc={r['enc']:3} -{r['rm']}/+{r['add']} regs-anon {r['regdiff']}  {r['dem']}")
    print()
    for t in tag_log:
        print(t)
    if problems:
        print('\nPROBLEMS:')
        for p in problems:
            print('  ' + p)
    return 0


if __name__ == '__main__':
    sys.exit(main())
