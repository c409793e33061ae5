#!/usr/bin/env python3
"""Fails when sibling modules of a crate import each other in a circle.

Siblings are the modules one parent module declares (the files of one directory, say). Module A
depends on sibling B when any code in A's files (its submodules included) names a path into B:
`use crate::..`, `use super::..`, `self::..`, such paths written inline, and, in the module that
declares them, its children by bare name. A circle among siblings means the two files are one
concept split in two, or a third concept is missing: move the shared part out, or merge.

Usage: scripts/check-import-cycles.py [--graph | --self-test] [CRATE_DIR...]   (default: every crates/*)
Prints each circle, `crate: parent: circle among a, b`, with one import that makes each edge, and
exits 1 when there is one that scripts/import-cycles-allowed.txt does not list, or when that
list names one that is gone (so the list only shrinks: delete the line). `--graph` also prints
every sibling edge.
"""
import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(text):
    """The source with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 260]) and not re.match(r"\w", text[i - 1] if i else " "):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{..}'), not a lifetime ('a).
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (whitespace already removed)."""
    depth = 0
    for k, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                prefix, inner = tree[:k], tree[k + 1:tree.rindex("}")]
                parts, level, start = [], 0, 0
                for m, c2 in enumerate(inner):
                    if c2 == "{":
                        level += 1
                    elif c2 == "}":
                        level -= 1
                    elif c2 == "," and level == 0:
                        parts.append(inner[start:m])
                        start = m + 1
                parts.append(inner[start:])
                result = []
                for p in parts:
                    if p:
                        result.extend(prefix + q for q in expand_use_tree(p))
                return result
            depth += 1
    return [re.sub(r"\bas\b.*$", "", tree)]


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names from the crate root
        self.file = file
        self.children = {}  # name -> Module (inline or file)
        self.refs = []  # (absolute target path tuple, line, text)


def parse_file(path_tuple, file, dir_for_children, modules, crate_dir):
    """Reads one module file and the modules it declares, recording each module's paths."""
    try:
        text = open(file, encoding="utf-8").read()
    except OSError:
        return
    clean = strip_comments_and_strings(text)
    root = Module(path_tuple, file)
    modules[path_tuple] = root
    # A stack of (module, brace depth at which it closes).
    stack = [(root, -1)]
    depth = 0
    token = re.compile(
        r"(?P<mod>\bmod\s+(?P<modname>" + IDENT + r")\s*(?P<modend>[;{]))"
        r"|(?P<use>\buse\s+(?P<tree>[^;]*);)"
        r"|(?P<path>\b(?:crate|super|self)(?:\s*::\s*" + IDENT + r")+)"
        r"|(?P<open>\{)|(?P<close>\})"
    )
    for m in token.finditer(clean):
        line = clean.count("\n", 0, m.start()) + 1
        current = stack[-1][0]
        if m.group("mod"):
            name = m.group("modname")
            if m.group("modend") == ";":
                # A file module: NAME.rs or NAME/mod.rs next to the declaring file.
                for candidate in (os.path.join(dir_for(current, dir_for_children), name + ".rs"),
                                  os.path.join(dir_for(current, dir_for_children), name, "mod.rs")):
                    if os.path.exists(candidate):
                        child_path = current.path + (name,)
                        child_dir = os.path.join(dir_for(current, dir_for_children), name)
                        dir_for_children[child_path] = child_dir
                        parse_file(child_path, candidate, dir_for_children, modules, crate_dir)
                        current.children[name] = modules.get(child_path)
                        break
            else:
                child = Module(current.path + (name,), file)
                modules[child.path] = child
                current.children[name] = child
                dir_for_children[child.path] = os.path.join(dir_for(current, dir_for_children), name)
                depth += 1
                stack.append((child, depth))
        elif m.group("open"):
            depth += 1
        elif m.group("close"):
            if stack[-1][1] == depth and len(stack) > 1:
                stack.pop()
            depth -= 1
        elif m.group("use"):
            tree = re.sub(r"\s+", "", m.group("tree"))
            tree = re.sub(r"^pub(\([^)]*\))?", "", re.sub(r"\s+", " ", m.group("tree")).strip())
            tree = re.sub(r"\s+", "", tree)
            for p in expand_use_tree(tree):
                current.refs.append((p.split("::"), line, "use " + p))
        elif m.group("path"):
            p = re.sub(r"\s+", "", m.group("path"))
            current.refs.append((p.split("::"), line, p))


def dir_for(module, dir_for_children):
    return dir_for_children[module.path]


def resolve(module, segments):
    """The absolute module path a reference from `module` names, or None if outside the crate."""
    segs = [s for s in segments if s]
    if not segs:
        return None
    if segs[0] == "crate":
        return tuple(segs[1:])
    base = list(module.path)
    if segs[0] == "self":
        segs = segs[1:]
    elif segs[0] == "super":
        while segs and segs[0] == "super":
            if not base:
                return None
            base.pop()
            segs = segs[1:]
    elif segs[0] in module.children:
        pass  # a child named bare (uniform paths)
    else:
        return None  # an extern crate, std, or a name in scope
    return tuple(base + segs)


def sibling_edges(modules):
    """{parent: {a: {b: (file, line, text)}}}: a child `a` of `parent` names sibling `b`."""
    edges = {}
    for mod in modules.values():
        for segments, line, text in mod.refs:
            target = resolve(mod, segments)
            if target is None:
                continue
            src = mod.path
            # The nearest common ancestor's children on each side are the siblings.
            k = 0
            while k < len(src) and k < len(target) and src[k] == target[k]:
                k += 1
            if k >= len(src) or k >= len(target):
                continue  # into an ancestor or a descendant of oneself: not a sibling
            parent, a, b = src[:k], src[k], target[k]
            if parent + (b,) not in modules:
                continue  # an item of the parent, not a module
            edges.setdefault(parent, {}).setdefault(a, {}).setdefault(
                b, (os.path.relpath(mod.file), line, text))
    return edges


def cycles(graph):
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def crate_roots(crate_dir):
    src = os.path.join(crate_dir, "src")
    roots = [os.path.join(src, f) for f in ("lib.rs", "main.rs")]
    bindir = os.path.join(src, "bin")
    if os.path.isdir(bindir):
        roots += [os.path.join(bindir, f) for f in sorted(os.listdir(bindir)) if f.endswith(".rs")]
    return [r for r in roots if os.path.exists(r)]


def self_test():
    """The check on two small crates: one whose siblings import each other (through a `use`
    group, `super::` and an inline path, with a test module's `super::` that must not count),
    one whose imports go one way. Returns 0 when it tells them apart."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        def crate(name, files):
            for rel, text in files.items():
                path = os.path.join(tmp, name, "src", rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w").write(text)
            modules, dirs = {}, {(): os.path.join(tmp, name, "src")}
            parse_file((), os.path.join(tmp, name, "src", "lib.rs"), dirs, modules, tmp)
            return {p: cycles(g) for p, g in sibling_edges(modules).items() if cycles(g)}
        circular = crate("circular", {
            "lib.rs": "mod a;\nmod b;\nmod c;\n",
            "a.rs": "use crate::{c::Z, b::{self, X}};\n",
            "b.rs": "// use crate::c::Z;\nfn f() { let s = \"crate::a::Y\"; super::a::g(); }\n",
            "c.rs": "pub struct Z;\n#[cfg(test)]\nmod tests {\n    use super::inner::Q;\n}\nmod inner {}\n",
        })
        one_way = crate("one_way", {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::X;\nmod tests { use super::super::b::Y; }\n",
            "b/mod.rs": "mod x;\npub use x::X;\n",
            "b/x.rs": "pub struct X;\n",
        })
    ok = circular == {(): [["a", "b"]]} and one_way == {}
    print(f"self-test: {'ok' if ok else 'FAILED'} (circular: {circular}, one-way: {one_way})")
    return 0 if ok else 1


def main(argv):
    if "--self-test" in argv:
        return self_test()
    show_graph = "--graph" in argv
    args = [a for a in argv if a != "--graph"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    crates = args or sorted(os.path.join(repo, "crates", c) for c in os.listdir(os.path.join(repo, "crates")))
    allowed_file = os.path.join(repo, "scripts", "import-cycles-allowed.txt")
    allowed = set()
    if os.path.exists(allowed_file) and not args:
        for entry in open(allowed_file, encoding="utf-8"):
            entry = entry.split("#", 1)[0].strip()
            if entry:
                allowed.add(entry)
    seen = set()
    found = 0
    for crate_dir in crates:
        name = os.path.basename(os.path.normpath(crate_dir))
        for root in crate_roots(crate_dir):
            modules, dirs = {}, {(): os.path.dirname(root)}
            parse_file((), root, dirs, modules, crate_dir)
            edges = sibling_edges(modules)
            for parent in sorted(edges):
                graph = edges[parent]
                where = "::".join(parent) or "(root)"
                if show_graph:
                    for a in sorted(graph):
                        for b in sorted(graph[a]):
                            print(f"{name} {os.path.basename(root)}: {where}: {a} -> {b}")
                for comp in cycles(graph):
                    key = f"{name}: {where}: {', '.join(comp)}"
                    seen.add(key)
                    if key in allowed:
                        continue
                    found += 1
                    print(f"{name}: {where}: circle among {', '.join(comp)}:")
                    members = set(comp)
                    for a in comp:
                        for b, (file, line, text) in sorted(graph[a].items()):
                            if b in members:
                                print(f"    {a} -> {b}   ({file}:{line}: {text})")
    gone = sorted(allowed - seen)
    for key in gone:
        print(f"{key}: no longer a circle: delete its line from {os.path.relpath(allowed_file)}")
    if found:
        print(f"{found} import circle(s) between sibling modules: move what both need into one "
              "place (or a new module), so that imports between siblings go one way")
    if found or gone:
        return 1
    print(f"no import circle between sibling modules beyond the {len(allowed)} known ones "
          f"({os.path.relpath(allowed_file)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
