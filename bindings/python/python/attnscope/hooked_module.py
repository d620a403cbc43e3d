"""TransformerLens's ``HookedRootModule`` for a user's own torch module (#59), as TL's Main_Demo
builds a toy model with it: ``self.hook_x = HookPoint()`` in any submodule, ``self.hook_x(value)``
in its ``forward``, ``setup()`` at the end of the root's ``__init__`` (it names each hook point by
its path, ``"layer1.hook_square"``), then ``run_with_hooks(x, fwd_hooks=[(name, fn)])``,
``run_with_cache(x)`` (every hook point's value, in the order they ran), ``hook_dict``,
``mod_dict``, ``hook_points()`` and ``reset_hooks()``. Forward hooks only (a backward hook on such
a module is refused: attnscope's backward is its engine's). Needs torch (imported here)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from .hook_points import HookPoint


class HookedRootModule(torch.nn.Module):
    """A torch module whose :class:`HookPoint` attributes (in it and its submodules) are hook
    points with TransformerLens's names, once :meth:`setup` has run."""

    def setup(self) -> None:
        self.hook_dict: Dict[str, HookPoint] = {}
        self.mod_dict: Dict[str, Any] = {}
        for path, module in self.named_modules():
            if path:
                self.mod_dict[path] = module
            for attr, value in list(vars(module).items()):
                if isinstance(value, HookPoint) and value._model is None:
                    value.name = f"{path}.{attr}" if path else attr
                    self.hook_dict[value.name] = value
                    self.mod_dict[value.name] = value

    def hook_points(self) -> List[HookPoint]:
        return list(self.hook_dict.values())

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False) -> None:
        for hp in self.hook_points():
            hp.remove_hooks("fwd", including_permanent=including_permanent)
            if clear_contexts:
                hp.clear_context()

    def _names(self, name: Any) -> List[str]:
        if callable(name):
            return [n for n in self.hook_dict if name(n)]
        if name not in self.hook_dict:
            raise KeyError(f"{name!r} is not a hook point of this module; it has {sorted(self.hook_dict)}")
        return [name]

    def run_with_hooks(self, *model_args: Any, fwd_hooks: Sequence[Tuple[Any, Callable]] = (),
                       bwd_hooks: Sequence[Tuple[Any, Callable]] = (), reset_hooks_end: bool = True,
                       clear_contexts: bool = False, **model_kwargs: Any) -> Any:
        """``self(*model_args, **model_kwargs)`` with ``fwd_hooks`` attached (removed after it
        unless ``reset_hooks_end=False``)."""
        if bwd_hooks:
            raise NotImplementedError("backward hooks on a user's own HookedRootModule: attnscope runs backward "
                                      "hooks through its engine only; use torch's register_full_backward_hook")
        added = []
        for name, fn in fwd_hooks:
            for n in self._names(name):
                self.hook_dict[n].add_hook(fn)
                added.append((self.hook_dict[n], fn))
        try:
            return self(*model_args, **model_kwargs)
        finally:
            if reset_hooks_end:
                for hp, fn in added:
                    hp._own = [e for e in hp._own if e[0] is not fn]

    def run_with_cache(self, *model_args: Any, names_filter: Any = None, **model_kwargs: Any) -> Tuple[Any, Dict[str, Any]]:
        """``(output, cache)``: each hook point's value (detached), keyed by its name, in the order
        the forward reached them; ``names_filter``: a name, a list of names or a predicate."""
        if names_filter is None:
            keep: Callable[[str], bool] = lambda n: True
        elif isinstance(names_filter, str):
            keep = lambda n: n == names_filter
        elif callable(names_filter):
            keep = names_filter
        else:
            keep = set(names_filter).__contains__
        cache: Dict[str, Any] = {}

        def save(x: Any, hook: HookPoint) -> None:
            cache[hook.name] = x.detach() if hasattr(x, "detach") else x
        out = self.run_with_hooks(*model_args, fwd_hooks=[(keep, save)], **model_kwargs)
        return out, cache
