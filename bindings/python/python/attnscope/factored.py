"""TransformerLens's ``FactoredMatrix``: a low-rank product ``A @ B`` kept as its two factors, so
circuits such as ``model.OV`` (``W_V @ W_O``, ``[layer, head, d_model, d_model]``) are studied
without forming the ``d_model × d_model`` products. Computed with numpy in float32 (float64 inside
the decompositions); results follow :func:`attnscope.set_array_type`."""

from __future__ import annotations

from typing import Any, Tuple

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
    ``get_corner``, ``collapse_l`` / ``collapse_r``, ``make_even``."""

    def __init__(self, A: Any, B: Any):
        A, B = _np(A), _np(B)
        if A.ndim < 2 or B.ndim < 2 or A.shape[-1] != B.shape[-2]:
            raise ValueError(f"FactoredMatrix needs A [..., l, m] and B [..., m, r]; got {A.shape} and {B.shape}")
        lead = np.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self._A = np.broadcast_to(A, lead + A.shape[-2:])
        self._B = np.broadcast_to(B, lead + B.shape[-2:])
        self.shape: Tuple[int, ...] = tuple(lead) + (self.ldim, self.rdim)
        self.has_leading_dims = len(lead) > 0

    A = property(lambda self: _wrap(np.ascontiguousarray(self._A)))
    B = property(lambda self: _wrap(np.ascontiguousarray(self._B)))
    ndim = property(lambda self: len(self.shape))

    @property
    def AB(self):
        """The full product ``[..., ldim, rdim]``."""
        return _wrap(self._A @ self._B)

    @property
    def BA(self):
        """``B @ A`` ``[..., mdim, mdim]`` (needs ldim == rdim)."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square product; this one is {self.ldim} × {self.rdim}")
        return _wrap(self._B @ self._A)

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(np.swapaxes(self._B, -1, -2), np.swapaxes(self._A, -1, -2))

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
        return FactoredMatrix(self._A[idx], self._B[idx])

    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):
            return (self @ other._A) @ other._B
        o = _np(other)
        if o.ndim < 2:
            return _wrap(self._A @ (self._B @ o))
        return FactoredMatrix(self._A, self._B @ o) if self.rdim > self.mdim else FactoredMatrix(_np(self.AB), o)

    def __rmatmul__(self, other):
        o = _np(other)
        if o.ndim < 2:
            return _wrap((o @ self._A) @ self._B)
        return FactoredMatrix(o @ self._A, self._B) if self.ldim > self.mdim else FactoredMatrix(o, _np(self.AB))

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
        return _wrap(self._A[..., :k, :] @ self._B[..., :, :k])

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"
