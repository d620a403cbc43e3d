#!/usr/bin/env python3
"""Count (and list) the library's public items as a Rust user sees them in rustdoc.

Reads rustdoc's JSON of the library (nightly):

    cargo +nightly rustdoc --lib --release -- -Z unstable-options --output-format json \
        --document-hidden-items
    python3 tools/public_items.py target/doc/attnscope.json            # counts by kind
    python3 tools/public_items.py target/doc/attnscope.json --markdown # docs/api.md's list

An item counts when it is reachable from the crate root through public paths that are not
`#[doc(hidden)]`: the walk skips hidden items and modules but follows a visible `pub use` into a
hidden module, as the rendered docs inline such a re-export (the JSON needs
`--document-hidden-items` for that: without it, rustdoc drops the re-exported item from its
index; a JSON made without it still counts right when nothing is re-exported from hidden modules). Each item counts once however many paths
reach it. Kinds: fn, struct, enum, trait, type, const, static, macro (modules are given apart).
The second figure is the members of the visible types: the public methods, associated consts
and types of their inherent impls, and the items a visible trait declares; the third, the
public fields and variants of the visible structs and enums.
"""
import json
import re
import sys
from collections import Counter

KINDS = {
    "function": "fn",
    "struct": "struct",
    "enum": "enum",
    "union": "union",
    "trait": "trait",
    "trait_alias": "trait",
    "type_alias": "type",
    "constant": "const",
    "static": "static",
    "macro": "macro",
    "proc_macro": "macro",
}


def hidden(item):
    return any("doc(hidden)" in json.dumps(a).replace(" ", "") for a in item["attrs"])


def kind_of(item):
    return next(iter(item["inner"]))


def walk(doc):
    """(path, id) of every visible item, modules included, first path found for each id."""
    index = doc["index"]
    seen = {}
    external = []
    stack = [("attnscope", doc["root"])]
    while stack:
        path, mid = stack.pop()
        for cid in index[str(mid)]["inner"]["module"]["items"]:
            item = index.get(str(cid))
            if item is None or hidden(item):
                continue
            if kind_of(item) == "use":
                use = item["inner"]["use"]
                target = index.get(str(use["id"])) if use["id"] is not None else None
                if target is None or target["crate_id"] != 0:
                    external.append(f"{path}::{use['name']} = {use['source']}")
                    continue
                if hidden(target):
                    continue
                if use["is_glob"]:
                    stack.append((path, use["id"]))
                    continue
                name, cid, item = use["name"], use["id"], target
            else:
                name = item["name"]
            if cid in seen:
                continue
            seen[cid] = f"{path}::{name}"
            if kind_of(item) == "module":
                stack.append((seen[cid], cid))
    return seen, external


def members(doc, seen):
    """(methods and associated items, fields and variants) of the visible types and traits."""
    index = doc["index"]
    methods, fields = [], []
    for cid, path in seen.items():
        item = index[str(cid)]
        kind = kind_of(item)
        inner = item["inner"][kind]
        if kind == "trait":
            methods += [(path, index[str(i)]) for i in inner["items"] if str(i) in index]
        if kind not in ("struct", "enum", "union"):
            continue
        for impl_id in inner.get("impls", []):
            imp = index[str(impl_id)]["inner"]["impl"]
            if imp["trait"] is None and not imp["is_synthetic"] and imp["blanket_impl"] is None:
                methods += [(path, index[str(i)]) for i in imp["items"] if str(i) in index]
        if kind == "enum":
            fields += [(path, index[str(i)]) for i in inner["variants"]]
        elif kind == "struct" and "plain" in inner["kind"]:
            fields += [(path, index[str(i)]) for i in inner["kind"]["plain"]["fields"]]
    return methods, fields


def summary(doc):
    seen, external = walk(doc)
    index = doc["index"]
    items = {c: p for c, p in seen.items() if kind_of(index[str(c)]) in KINDS}
    modules = len(seen) - len(items)
    by_kind = Counter(KINDS[kind_of(index[str(c)])] for c in items)
    methods, fields = members(doc, items)
    undocumented = [p for c, p in items.items() if not index[str(c)]["docs"]]
    undocumented += [f"{p}::{m['name']}" for p, m in methods + fields if not m["docs"]]
    return items, modules, by_kind, methods, fields, external, undocumented


def print_counts(doc):
    items, modules, by_kind, methods, fields, external, undocumented = summary(doc)
    print(f"visible items: {len(items)} ({', '.join(f'{k} {n}' for k, n in by_kind.most_common())})")
    print(f"visible modules: {modules}")
    print(f"members of visible types and traits (methods, assoc consts/types): {len(methods)}")
    print(f"fields and variants of visible structs and enums: {len(fields)}")
    print(f"re-exports of other crates' items: {len(external)}")
    print(f"undocumented (items, members, fields): {len(undocumented)}")
    for path in sorted(undocumented)[:40]:
        print(f"  undocumented: {path}")


def first_line(docs):
    text = (docs or "").strip().split("\n\n")[0].replace("\n", " ")
    text = re.sub(r"\[(`[^`]*`)\](\([^)]*\))?", r"\1", text)  # intra-doc links as code
    text = text.replace("|", "\\|")
    sentence = re.match(r"(.+?\.)(\s|$)", text)
    text = sentence.group(1) if sentence else text
    if len(text) > 160:
        text = text[:157].rsplit(" ", 1)[0] + " ..."
        text += "`" if text.count("`") % 2 else ""
    return text


def print_markdown(doc):
    items, modules, by_kind, methods, fields, external, _ = summary(doc)
    index = doc["index"]
    kinds = ", ".join(f"{n} {k}" for k, n in by_kind.most_common())
    print("# The library's public items")
    print()
    print("What a Rust user of the `attnscope` crate sees (`cargo doc --no-deps --lib --open`):")
    print("the crate root's re-exports (`src/lib.rs`), the `reference` oracle and the `fixtures`")
    print("module. Every other module stays reachable by its path for the project's tests,")
    print("benchmarks, fuzz targets and Python binding, but is `#[doc(hidden)]`: not part of the")
    print("supported surface. Generated by `tools/public_items.py` from rustdoc's JSON (its header")
    print("says how); `tests/docs_consistency.rs` · `api_md_lists_lib_rs_re_exports` checks the list")
    print("against `src/lib.rs`.")
    print()
    print("| Item | Kind | What it is |")
    print("|---|---|---|")
    for cid, path in sorted(items.items(), key=lambda e: (e[1].count("::"), e[1])):
        item = index[str(cid)]
        print(f"| `{path}` | {KINDS[kind_of(item)]} | {first_line(item['docs'])} |")
    print()
    print(f"{len(items)} items ({kinds}); {len(methods)} methods and associated items of these "
          f"types; {len(fields)} fields and variants.")


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: public_items.py target/doc/attnscope.json [--markdown]")
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    if "--markdown" in sys.argv[2:]:
        print_markdown(doc)
    else:
        print_counts(doc)


if __name__ == "__main__":
    main()
