"""TransformerLens's ``FactoredMatrix``: a low-rank product ``A @ B`` kept as its two factors, so
circuits such as ``model.OV`` (``W_V @ W_O``, ``[layer, head, d_model, d_model]``) are studied
without forming the ``d_model × d_model`` products. Computed with numpy in float32 (float64 inside
the decompositions); results follow :func:`attnscope.set_array_type`."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np


def _wrap(a: Any) -> Any:
    from . import _wrap as wrap  # the package's array-type rule
    return wrap(a)


def _np(a: Any) -> np.ndarray:
    from . import _np as to_np
    return to_np(a)


class FactoredMatrix:
    """``A @ B`` with ``A: [..., ldim, mdim]`` and ``B: [..., mdim, rdim]`` (leading dims
    broadcast), as TransformerLens's ``FactoredMatrix``: ``AB``, ``BA``, ``T``, ``svd()`` / ``U`` /
    ``S`` / ``Vh``, ``eigenvalues`` (of ``BA``, the non-zero ones of ``AB``), ``norm()``
    (Frobenius), indexing of the leading dims, ``@`` with arrays and other factored matrices,
    ``get_corner``, ``collapse_l`` / ``collapse_r``, ``make_even``.

    A 2-D matrix multiplied on the outside where TransformerLens folds it into a factor (``W_E @
    model.OV @ W_U``: its ``A`` becomes ``W_E @ A``, its ``B`` ``B @ W_U``) is kept beside the
    factors instead, and folded in only when ``A``, ``B`` or a product that needs them is read:
    the full OV circuit of SmolLM2 (factors of 2 x 3.4 GB in TransformerLens) then takes no
    memory, and its ``eigenvalues``, ``BA`` and ``get_corner`` are computed through the small
    ``W_U @ W_E`` (``B @ (W_U @ W_E) @ A``: the same product, summed in another order)."""

    # `array @ FactoredMatrix` comes to __rmatmul__ (numpy would treat this as a 0-d object)
    __array_ufunc__ = None

    def __init__(self, A: Any, B: Any):
        self._setup(_np(A), _np(B), None, None)

    def _setup(self, A: np.ndarray, B: np.ndarray, _left: Optional[np.ndarray], _right: Optional[np.ndarray]) -> None:
        if A.ndim < 2 or B.ndim < 2 or A.shape[-1] != B.shape[-2]:
            raise ValueError(f"FactoredMatrix needs A [..., l, m] and B [..., m, r]; got {A.shape} and {B.shape}")
        lead = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self._a = np.broadcast_to(A, lead + A.shape[-2:])
        self._b = np.broadcast_to(B, lead + B.shape[-2:])
        # the outer 2-D matrices not yet folded in: left [ldim, A's rows], right [B's columns, rdim]
        self._left, self._right = _left, _right
        self.ldim = A.shape[-2] if _left is None else _left.shape[0]
        self.mdim = A.shape[-1]
        self.rdim = B.shape[-1] if _right is None else _right.shape[1]
        self.shape: Tuple[int, ...] = tuple(lead) + (self.ldim, self.rdim)
        self.has_leading_dims = len(lead) > 0
        self._folded: dict = {}

    @property
    def _A(self) -> np.ndarray:
        """``A`` with the outer left matrix folded in (once)."""
        if self._left is None:
            return self._a
        if "A" not in self._folded:
            self._folded["A"] = self._left @ self._a
        return self._folded["A"]

    @property
    def _B(self) -> np.ndarray:
        """``B`` with the outer right matrix folded in (once)."""
        if self._right is None:
            return self._b
        if "B" not in self._folded:
            self._folded["B"] = self._b @ self._right
        return self._folded["B"]

    A = property(lambda self: _wrap(np.ascontiguousarray(self._A)))
    B = property(lambda self: _wrap(np.ascontiguousarray(self._B)))
    ndim = property(lambda self: len(self.shape))

    @staticmethod
    def _with(a: np.ndarray, b: np.ndarray, left: Optional[np.ndarray], right: Optional[np.ndarray]) -> "FactoredMatrix":
        """``left @ a @ b @ right`` with ``left`` and ``right`` (2-D, or None) kept apart."""
        f = FactoredMatrix.__new__(FactoredMatrix)
        f._setup(a, b, left, right)
        return f

    @property
    def AB(self):
        """The full product ``[..., ldim, rdim]``."""
        return _wrap(self._A @ self._B)

    @property
    def BA(self):
        """``B @ A`` ``[..., mdim, mdim]`` (needs ldim == rdim)."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square product; this one is {self.ldim} × {self.rdim}")
        a, b, left, right = self._a, self._b, self._left, self._right
        if left is not None and right is not None:
            return _wrap((b @ (right @ left)) @ a)
        if right is not None:
            return _wrap(b @ (right @ a))
        if left is not None:
            return _wrap((b @ left) @ a)
        return _wrap(b @ a)

    @property
    def T(self) -> "FactoredMatrix":
        sw = lambda x: np.swapaxes(x, -1, -2)
        return self._with(sw(self._b), sw(self._a), None if self._right is None else self._right.T,
                          None if self._left is None else self._left.T)

    def svd(self):
        """The compact SVD of ``AB`` from the factors' SVDs: ``U [..., ldim, mdim]``, ``S [..., mdim]``,
        ``Vh [..., rdim, mdim]`` (TransformerLens's convention: ``AB = U @ diag(S) @ Vh.T``)."""
        A, B = self._A.astype(np.float64), self._B.astype(np.float64)
        Ua, Sa, Vha = np.linalg.svd(A, full_matrices=False)
        Ub, Sb, Vhb = np.linalg.svd(B, full_matrices=False)
        middle = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]
        Um, Sm, Vhm = np.linalg.svd(middle, full_matrices=False)
        U = Ua @ Um
        Vh = np.swapaxes(Vhb, -1, -2) @ np.swapaxes(Vhm, -1, -2)
        return _wrap(U.astype(np.float32)), _wrap(Sm.astype(np.float32)), _wrap(Vh.astype(np.float32))

    U = property(lambda self: self.svd()[0])
    S = property(lambda self: self.svd()[1])
    Vh = property(lambda self: self.svd()[2])

    @property
    def eigenvalues(self):
        """The eigenvalues of ``BA`` (complex): the non-zero eigenvalues of ``AB``."""
        return _wrap(np.linalg.eigvals(_np(self.BA).astype(np.float64)).astype(np.complex64))

    def norm(self):
        """The Frobenius norm of ``AB``, ``sqrt(Σ S²)``."""
        return _wrap(np.sqrt((_np(self.S).astype(np.float64) ** 2).sum(-1)).astype(np.float32))

    def __getitem__(self, idx) -> "FactoredMatrix":
        idx = idx if isinstance(idx, tuple) else (idx,)
        lead = len(self.shape) - 2
        if len([i for i in idx if i is not None]) > lead:
            raise IndexError(f"a FactoredMatrix indexes its {lead} leading dims only (shape {self.shape})")
        return self._with(self._a[idx], self._b[idx], self._left, self._right)

    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):
            return (self @ other._A) @ other._B
        o = _np(other)
        if o.ndim < 2:
            v = o if self._right is None else self._right @ o
            v = self._a @ (self._b @ v)
            return _wrap(v if self._left is None else v @ self._left.T)
        if self.rdim > self.mdim:
            if o.ndim == 2:  # TransformerLens's B @ o, kept apart
                return self._with(self._a, self._b, self._left, o if self._right is None else self._right @ o)
            return FactoredMatrix(self._A, self._B @ o)
        return FactoredMatrix(_np(self.AB), o)

    def __rmatmul__(self, other):
        o = _np(other)
        if o.ndim < 2:
            v = o if self._left is None else o @ self._left
            v = (v @ self._a) @ self._b
            return _wrap(v if self._right is None else v @ self._right)
        if self.ldim > self.mdim:
            if o.ndim == 2:  # TransformerLens's o @ A, kept apart
                return self._with(self._a, self._b, o if self._left is None else o @ self._left, self._right)
            return FactoredMatrix(o @ self._A, self._B)
        return FactoredMatrix(o, _np(self.AB))

    def collapse_l(self):
        """``S[..., :, None] * Vh.T``: the product with the left factor's orthonormal part dropped."""
        _, S, Vh = (_np(x) for x in self.svd())
        return _wrap(S[..., :, None] * np.swapaxes(Vh, -1, -2))

    def collapse_r(self):
        """``U * S[..., None, :]``: the product with the right factor's orthonormal part dropped."""
        U, S, _ = (_np(x) for x in self.svd())
        return _wrap(U * S[..., None, :])

    def make_even(self) -> "FactoredMatrix":
        """The same product with factors ``U √S`` and ``√S Vh.T`` of equal weight."""
        U, S, Vh = (_np(x) for x in self.svd())
        r = np.sqrt(S)
        return FactoredMatrix(U * r[..., None, :], r[..., :, None] * np.swapaxes(Vh, -1, -2))

    def get_corner(self, k: int = 3):
        """The top-left ``k × k`` corner of ``AB`` (of every leading index), computed from the factors."""
        a = self._a[..., :k, :] if self._left is None else self._left[:k] @ self._a
        b = self._b[..., :, :k] if self._right is None else self._b @ self._right[:, :k]
        return _wrap(a @ b)

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"
