"""Shared by the Python bench scripts beside it: where the models are, the reference side's
imports (optional in a smoke run, said loudly when missing), and the table each script ends with.

Each script takes ``--smoke``: one short run on tiny inputs that checks the script still runs
against today's CLI and prints its table (tests/bench_scripts.rs runs them so in CI); its times
are not worth quoting."""
import os
import sys


def models_dir():
    """The cache's models folder as attnscope finds it: ``$ATTNSCOPE_CACHE/models``, else the
    user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``) + ``attnscope/models``."""
    cache = os.environ.get("ATTNSCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnscope")
    return os.path.join(cache, "models")


def reference(smoke, what, importer):
    """``importer()``: the reference side's modules. Missing in a smoke run: None, said loudly on
    standard error (the script then runs attnscope's side alone); missing in a real run: exit 2."""
    try:
        return importer()
    except ImportError as e:
        msg = f"the {what} side needs {e.name or 'a module'} ({e})"
        if not smoke:
            print(f"error: {msg}; run with the reference Python (~/.hfenv/bin/python), as the docstring says",
                  file=sys.stderr)
            raise SystemExit(2)
        print(f"NOT RUN: {msg}; this smoke run times attnscope's side alone. Run it with the reference "
              "Python (~/.hfenv/bin/python) to compare", file=sys.stderr, flush=True)
        return None


def table(columns, rows):
    """Prints ``rows`` (dicts keyed by ``columns``) as a Markdown table, header first; a float with
    three significant decimals, a missing value as ``-``."""
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e-3 and v != 0 else f"{v:.3f}"
        return str(v)

    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(cell(r.get(c)) for c in columns) + " |")
