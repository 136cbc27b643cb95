"""Datasets to learn from: the paper's synthetic tasks and imports of real data.

- :func:`make_mhla` / :func:`generate_mhla`: realizable data from an H-head MHLA teacher ([Y25] §4.1;
  DESIGN §9): ``V, Q ~ N(0,1)/sqrt(d)``, tokens ``Z ~ N(0,1)/sqrt(T)``, ``y = sum_h V_h Z^T Z Q_h x``.
- :func:`make_assoc` / :func:`generate_assoc`: the associative-memory task ([Y25] §4.2).
- :func:`import_arrays`, :func:`import_csv`, :func:`load_digits_dataset`: user arrays and real data.
"""
from __future__ import annotations

import os

import numpy as np

from . import _storage
from .dataset import DatasetError, create_dataset, open_dataset, write_block, write_dataset, write_teacher


def make_teacher(d: int, heads: int, d_out: int | None = None, seed=0):
    """Random MHLA teacher ``V (H, d_out, d)``, ``Q (H, d, d)`` with entries ``N(0,1)/sqrt(d)`` ([Y25] §4.1)."""
    rng = np.random.default_rng(seed)
    d_out = d if d_out is None else d_out
    V = rng.standard_normal((heads, d_out, d)) / np.sqrt(d)
    Q = rng.standard_normal((heads, d, d)) / np.sqrt(d)
    return V, Q


def mhla_forward(V, Q, tokens, lengths=None, causal=False):
    """Teacher predictions ``sum_h V_h S Q_h x`` ([Y25] Def. 2.1; DESIGN §1), computed directly from the heads.

    Returns (n, d_out) or, with ``causal``, (n, T, d_out) (zero at padding positions).
    """
    z = np.asarray(tokens, dtype=np.float64)
    n, T, d = z.shape
    if lengths is not None:
        z = z * (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[..., None]
    if causal:
        S = np.cumsum(np.einsum("ntj,ntk->ntjk", z, z), axis=1)  # (n, T, d, d)
        y = np.einsum("haj,ntjk,hkl,ntl->nta", V, S, Q, z, optimize=True)
        if lengths is not None:
            y *= (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[..., None]
        return y
    S = np.einsum("ntj,ntk->njk", z, z)
    last = (np.asarray(lengths) - 1) if lengths is not None else np.full(n, T - 1)
    x = z[np.arange(n), last]
    return np.einsum("haj,njk,hkl,nl->na", V, S, Q, x, optimize=True)


def make_mhla(
    d: int = 2, heads: int = 1, length: int = 100, samples: int = 512, *, d_out=None, noise: float = 0.0,
    causal: bool = False, variable_lengths: bool = False, teacher=None, seed=0,
):
    """In-memory realizable MHLA data: returns ``dict(tokens, targets, lengths, V, Q)``.

    ``teacher=(V, Q)`` reuses a teacher (a fresh dataset from the same model); otherwise one is drawn from
    ``seed``. ``variable_lengths`` draws lengths uniformly in [1, T] and zero-pads.
    """
    V, Q = make_teacher(d, heads, d_out, seed) if teacher is None else teacher
    rng = np.random.default_rng([*np.atleast_1d(seed).tolist(), 1])
    tokens = rng.standard_normal((samples, length, d)) / np.sqrt(length)
    lengths = rng.integers(1, length + 1, samples) if variable_lengths else None
    if lengths is not None:
        tokens *= (np.arange(length)[None, :] < lengths[:, None])[..., None]
    y = mhla_forward(V, Q, tokens, lengths, causal)
    if noise:
        y = y + noise * rng.standard_normal(y.shape)
        if causal and lengths is not None:
            y *= (np.arange(length)[None, :] < lengths[:, None])[..., None]
    return dict(tokens=tokens, targets=y, lengths=lengths, V=V, Q=Q)


def generate_mhla(
    url, d: int = 2, heads: int = 1, length: int = 100, samples: int = 512, *, d_out=None, noise: float = 0.0,
    causal: bool = False, variable_lengths: bool = False, seed: int = 0, chunk_samples=None,
    overwrite: bool = False, storage_options=None,
):
    """Write a realizable MHLA dataset (teacher kept under ``teacher/``) chunk by chunk; return it opened.

    Memory is bounded by one slab of samples, whatever ``samples`` is.
    """
    _positive(d=d, heads=heads, length=length, samples=samples)
    V, Q = make_teacher(d, heads, d_out, seed)
    attrs = {"generator": {"task": "mhla", "d": d, "heads": heads, "length": length, "samples": samples,
                           "d_out": int(V.shape[1]), "noise": noise, "causal": causal, "seed": seed},
             "description": "realizable multi-head linear attention data [Yau et al. 2025, Sec. 4.1]"}
    with _storage.atomic_output(url, overwrite, storage_options) as tmp:
        g = create_dataset(tmp, samples, length, d, V.shape[1], causal=causal, lengths=variable_lengths,
                           chunk_samples=chunk_samples, attrs=attrs, storage_options=storage_options)
        chunk = g["tokens"].chunks[0]
        for i, a in enumerate(range(0, samples, chunk)):
            b = min(samples, a + chunk)
            part = make_mhla(d, heads, length, b - a, noise=noise, causal=causal,
                             variable_lengths=variable_lengths, teacher=(V, Q), seed=[seed, i])
            write_block(g, a, part["tokens"], part["targets"], part["lengths"])
        write_teacher(g, V, Q)
    return open_dataset(url, storage_options)


def make_assoc(pairs: int = 2, samples: int = 2**14, *, dim: int | None = None, orthogonal: bool = False, seed=0):
    """Associative-memory data ([Y25] §4.2; DESIGN §9): ``dict(tokens, targets)``.

    Token j = (k_j; v_j) for j = 1..K, last token (q; zeta) with q one of the keys, zeta ~ N(0, I);
    target = (0; sum_j <q, k_j> v_j). Keys/values are unit-norm Gaussian, or with ``orthogonal`` the rows of
    a fresh random orthogonal matrix per sample (not identifiable). Token dimension ``2 * dim``.
    """
    dim = pairs if dim is None else dim
    if orthogonal and pairs > dim:
        raise ValueError(f"orthogonal keys need pairs <= dim, got pairs={pairs}, dim={dim}")
    rng = np.random.default_rng(seed)

    def draw():
        if orthogonal:
            qk = np.linalg.qr(rng.standard_normal((samples, dim, dim)))[0]
            return np.swapaxes(qk, 1, 2)[:, :pairs]  # orthonormal rows
        g = rng.standard_normal((samples, pairs, dim))
        return g / np.linalg.norm(g, axis=-1, keepdims=True)

    k, v = draw(), draw()
    q = k[np.arange(samples), rng.integers(0, pairs, samples)]
    zeta = rng.standard_normal((samples, dim))
    tokens = np.concatenate([np.concatenate([k, v], -1), np.concatenate([q, zeta], -1)[:, None]], 1)
    out = np.einsum("nj,njd->nd", np.einsum("nd,njd->nj", q, k), v)
    targets = np.concatenate([np.zeros_like(out), out], -1)
    return dict(tokens=tokens, targets=targets)


def generate_assoc(url, pairs: int = 2, samples: int = 2**14, *, dim=None, orthogonal=False, seed=0,
                   chunk_samples=None, overwrite=False, storage_options=None):
    """Write an associative-memory dataset (:func:`make_assoc`); return it opened."""
    _positive(pairs=pairs, samples=samples)
    data = make_assoc(pairs, samples, dim=dim, orthogonal=orthogonal, seed=seed)
    attrs = {"generator": {"task": "assoc", "pairs": pairs, "dim": dim or pairs, "samples": samples,
                           "orthogonal": orthogonal, "seed": seed},
             "description": "associative memory task [Yau et al. 2025, Sec. 4.2]"}
    return write_dataset(url, data["tokens"], data["targets"], chunk_samples=chunk_samples, attrs=attrs,
                         overwrite=overwrite, storage_options=storage_options)


def windows(series, length: int, horizon: int = 1, step: int = 1, causal: bool = False):
    """Cut a multivariate time series (time, d) into windows of ``length`` tokens.

    Last-token targets: the value ``horizon`` steps after each window, (N, d). Causal targets: every
    prefix predicts its next value, (N, T, d) (``horizon`` = 1).
    """
    x = np.asarray(series, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    span = length + (1 if causal else horizon)
    starts = np.arange(0, x.shape[0] - span + 1, step)
    if starts.size == 0:
        raise DatasetError(f"series of {x.shape[0]} steps is too short for windows of {length} + {horizon}")
    tokens = np.stack([x[s : s + length] for s in starts])
    if causal:
        targets = np.stack([x[s + 1 : s + length + 1] for s in starts])
    else:
        targets = np.stack([x[s + length + horizon - 1] for s in starts])
    return tokens, targets


def standardize(series):
    """Per-column z-score of a (time, d) series (constant columns are left centred)."""
    x = np.asarray(series, dtype=np.float64)
    sd = x.std(axis=0)
    return (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)


def import_arrays(url, path, *, tokens="tokens", targets="targets", lengths="lengths", overwrite=False,
                  storage_options=None):
    """Import a ``.npz`` (arrays named ``tokens``, ``targets``, optional ``lengths``) or a ``.npy`` of tokens.

    Files are read with ``allow_pickle=False``: object arrays are refused, never unpickled.
    """
    try:
        if str(path).endswith(".npz"):
            with np.load(path, allow_pickle=False) as f:
                if tokens not in f:
                    raise DatasetError(f"{path}: missing array {tokens!r} (found {sorted(f.files)})")
                arrs = {k: f[k] for k in f.files}
            tok, y, lens = arrs[tokens], arrs.get(targets), arrs.get(lengths)
        else:
            tok, y, lens = np.load(path, allow_pickle=False), None, None
    except ValueError as e:  # object arrays need pickle
        raise DatasetError(f"{path}: cannot read without unpickling ({e})") from None
    for name, a in (("tokens", tok), ("targets", y)):
        if a is not None and not np.issubdtype(a.dtype, np.floating):
            raise DatasetError(f"{name}: expected a float dtype, got {a.dtype}")
    if tok.ndim != 3:
        raise DatasetError(f"tokens: expected 3 dimensions (sample, position, embed), got shape {tok.shape}")
    attrs = {"description": f"imported from {os.path.basename(str(path))}"}
    return write_dataset(url, tok, y, lens, attrs=attrs, overwrite=overwrite, storage_options=storage_options)


def import_csv(url, path, *, length: int, horizon: int = 1, step: int = 1, causal=False, columns=None,
               standardize_columns=True, overwrite=False, storage_options=None):
    """Import a CSV of a multivariate time series (header row, one column per variable) cut into windows."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    cols = list(range(len(header))) if columns is None else [header.index(c) for c in columns]
    try:
        x = np.array([[float(r[c]) for c in cols] for r in body], dtype=np.float64)
    except (ValueError, IndexError) as e:
        raise DatasetError(f"{path}: non-numeric or missing value ({e})") from None
    if standardize_columns:
        x = standardize(x)
    tok, y = windows(x, length, horizon, step, causal)
    attrs = {"description": f"windows of {os.path.basename(str(path))}", "columns": [header[c] for c in cols],
             "window": {"length": length, "horizon": horizon, "step": step}}
    return write_dataset(url, tok, y, attrs=attrs, overwrite=overwrite, storage_options=storage_options)


def load_digits_dataset(url, *, overwrite=False, storage_options=None):
    """scikit-learn's handwritten digits (1,797 images of 8x8) as sequences of the first 7 pixel rows
    (d = 8, scaled to [0, 1]) predicting the 8th row (d_out = 8): a real, non-realizable regression."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the built-in digits dataset needs scikit-learn: pip install 'scaleattn[data]' "
                          "(or pip install scikit-learn)") from None
    img = load_digits().images / 16.0  # (1797, 8, 8)
    attrs = {"description": "sklearn digits: rows 0-6 of each 8x8 image predict row 7", "source": "sklearn.datasets.load_digits"}
    return write_dataset(url, img[:, :7], img[:, 7], attrs=attrs, overwrite=overwrite, storage_options=storage_options)


def _positive(**kw):
    for k, v in kw.items():
        if v is None or int(v) < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")


def make_icl_regression(k: int = 4, context: int = 20, samples: int = 4096, seed=0):
    """In-context linear regression (Garg et al. 2022; von Oswald et al. 2023): ``dict(tokens, targets)``.

    Each sample draws ``w ~ N(0, I_k)`` and ``x_i ~ N(0, I_k)``; tokens (samples, context + 1, k + 1) float64
    are ``(x_i, w^T x_i)`` for ``i < context`` and the query ``(x_q, 0)`` last; targets (samples, 1) are
    ``w^T x_q`` (last-token data, d = k + 1, d_out = 1). ``seed``: anything ``numpy.random.default_rng`` takes.
    Raises ``ValueError`` for ``k``, ``context`` or ``samples`` below 1.
    """
    _positive(k=k, context=context, samples=samples)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((samples, k))
    x = rng.standard_normal((samples, context + 1, k))
    y = np.einsum("ntk,nk->nt", x, w)
    tokens = np.concatenate([x, y[..., None]], -1)
    tokens[:, -1, k] = 0.0  # the query's label slot
    return dict(tokens=tokens, targets=y[:, -1:].copy())
