"""The package's public Python surface, as data: every public name of ``attnscope`` (and of its
public modules ``utils``, ``viz``, ``patching``, ...), what each is, each public class's public
attributes with their signatures (``inspect.signature``), and the native module's functions and
classes. ``test_api_surface.py`` compares it with ``api_surface.json`` (recorded before #57 split
the binding by domain), so a name or a signature lost by accident fails.

Rewrite the record, after a deliberate change of the surface, with
``python bindings/python/tests/api_surface.py --write`` (and read its diff)."""

import inspect
import json
import re
import sys
import types
from pathlib import Path

RECORD = Path(__file__).with_name("api_surface.json")
# the modules whose public names are the surface besides the package's own (the import paths a
# user writes: attnscope.utils.get_act_name, attnscope.viz.attention_heads, ...)
MODULES = ("utils", "viz", "patching", "processing", "hook_points", "factored", "bridge", "distributed",
           "inputs", "tokenizer", "_native")


def signature(obj):
    """``inspect.signature``'s text (a default that is a function without its address), or why
    there is none."""
    try:
        return re.sub(r" at 0x[0-9a-f]+>", ">", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "<no signature>"


def kind(obj):
    """What a public name is: a module, a class, a function, or a value's type."""
    if isinstance(obj, types.ModuleType):
        return "module " + obj.__name__
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function" + signature(obj)
    return "value " + type(obj).__name__


def member(cls, name):
    """One class attribute: a method with its signature, a property, or a value's type."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, property):
        return "property"
    if isinstance(raw, (staticmethod, classmethod)):
        return type(raw).__name__ + signature(getattr(cls, name))
    if callable(raw):
        return "method" + signature(raw)
    return "value " + type(raw).__name__


def class_surface(cls):
    return {n: member(cls, n) for n in sorted(dir(cls)) if not n.startswith("_") or n in ("__init__", "__call__")}


def foreign(name, obj):
    """A name a module imported from outside attnscope (``np``, ``os``, ``Any``, ``dataclass``,
    ``annotations``): not attnscope's surface, and free to go when the imports change."""
    if isinstance(obj, types.ModuleType):
        return not obj.__name__.startswith("attnscope")
    home = sys.modules.get(getattr(obj, "__module__", None) or "")
    return home is not None and not home.__name__.startswith("attnscope") and getattr(home, name, None) is obj


def module_surface(mod):
    names = {n: kind(getattr(mod, n)) for n in sorted(dir(mod))
             if (not n.startswith("_") or n in ("__version__", "_native")) and not foreign(n, getattr(mod, n))}
    classes = {n: class_surface(getattr(mod, n)) for n in names if inspect.isclass(getattr(mod, n))
               and getattr(getattr(mod, n), "__module__", "").startswith("attnscope")}
    return {"names": names, "classes": classes}


def surface():
    import attnscope
    import attnscope.distributed  # noqa: F401
    import attnscope.patching  # noqa: F401
    out = {"attnscope": module_surface(attnscope)}
    for m in MODULES:
        out["attnscope." + m] = module_surface(getattr(attnscope, m))
    return out


if __name__ == "__main__":
    text = json.dumps(surface(), indent=1, sort_keys=True) + "\n"
    if sys.argv[1:] == ["--write"]:
        RECORD.write_text(text)
        print(f"wrote {RECORD}")
    else:
        sys.stdout.write(text)
