"""Synthetic datasets: the paper's tasks, in memory (``make_*``) or written as datasets
(``generate_*``), as scikit-learn keeps ``make_*`` apart from ``load_*`` (real data: :mod:`scaleattn.importers`).

- :func:`make_mhla` / :func:`generate_mhla`: realizable data from an H-head MHLA teacher ([Y25] §4.1;
  DESIGN §9): ``V, Q ~ N(0,1)/sqrt(d)``, tokens ``Z ~ N(0,1)/sqrt(T)``, ``y = sum_h V_h Z^T Z Q_h x``.
- :func:`make_assoc` / :func:`generate_assoc`: the associative-memory task ([Y25] §4.2).
- :func:`make_icl_regression`: in-context linear regression.
"""
from __future__ import annotations

import numpy as np

from ._params import integer, real
from .data._checks import MAX_TARGET
from .data._dataset import open_dataset
from .data._writer import (
    create_dataset,
    default_chunk_samples,
    finish_dataset,
    write_block,
    write_dataset,
    write_teacher,
)
from .distributed.memory import GIB, available_memory
from .errors import InsufficientMemoryError, ParameterError
from .importers import (  # noqa: F401 (moved)
    import_arrays,
    import_csv,
    load_digits_dataset,
    standardize,
    windows,
)
from .store import _formats
from .store._location import check_path, check_storage_options, resolve
from .store._outputs import atomic_output

__all__ = ["make_teacher", "mhla_forward", "make_mhla", "generate_mhla", "make_assoc", "generate_assoc",
           "make_icl_regression"]


def make_teacher(d: int, heads: int, d_out: int | None = None, seed=0):
    """Random MHLA teacher ``V (H, d_out, d)``, ``Q (H, d, d)`` with entries ``N(0,1)/sqrt(d)`` ([Y25] §4.1)."""
    rng = np.random.default_rng(seed)
    d_out = d if d_out is None else d_out
    V = rng.standard_normal((heads, d_out, d)) / np.sqrt(d)
    Q = rng.standard_normal((heads, d, d)) / np.sqrt(d)
    return V, Q


#: bytes of the prefix Grams the causal teacher holds at once
FORWARD_BYTES = 1 << 28


def mhla_forward(V, Q, tokens, lengths=None, causal=False):
    """Teacher predictions ``sum_h V_h S Q_h x`` ([Y25] Def. 2.1; DESIGN §1), computed directly from the heads.

    Returns (n, d_out) or, with ``causal``, (n, T, d_out) (zero at padding positions).
    """
    z = np.asarray(tokens, dtype=np.float64)
    n, T, d = z.shape
    if lengths is not None:
        z = z * (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[..., None]
    if causal:
        # every prefix's d x d Gram is held for a block of sequences at a time (13 GB for 400,000 rows at d = 64)
        step = max(1, FORWARD_BYTES // (8 * T * d * d))
        y = np.empty((n, T, V.shape[1]))
        for a in range(0, n, step):
            S = np.cumsum(np.einsum("ntj,ntk->ntjk", z[a:a + step], z[a:a + step]), axis=1)  # (rows, T, d, d)
            y[a:a + step] = np.einsum("haj,ntjk,hkl,ntl->nta", V, S, Q, z[a:a + step], optimize=True)
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
    causal: bool = False, variable_lengths: bool = False, seed: int = 0, teacher_seed: int | None = None,
    chunk_samples=None, overwrite: bool = False, storage_options=None,
):
    """Write a realizable MHLA dataset (teacher kept under ``teacher/``) chunk by chunk; return it opened.

    Parameters
    ----------
    url : str, path-like or Location
        The dataset to write.
    d, heads, length, samples : int
        Token dimension, teacher heads, tokens per sequence T, sequences N (all >= 1).
    d_out : int, optional
        Output dimension (default d).
    noise : float
        Standard deviation of Gaussian target noise, in ``[0, MAX_TARGET / 10]`` (larger targets are refused by a
        fit: :data:`scaleattn.data._checks.MAX_TARGET`).
    causal : bool
        Targets at every prefix (N, T, d_out).
    variable_lengths : bool
        Random lengths in [1, T], zero padded.
    seed : int
        Seed of the tokens (and noise, and lengths), and of the teacher unless ``teacher_seed``.
    teacher_seed : int, optional
        Seed of the teacher alone (default ``seed``: the same bits as without it). Held-out data of a teacher is
        its ``teacher_seed`` with another ``seed``: the same ``V``, ``Q`` on tokens drawn afresh (the same
        ``seed`` with another ``length`` or ``samples`` redraws from the same stream: its sequences are parts
        of the first dataset's, rescaled).
    chunk_samples : int, optional
        Sequences per Zarr chunk (default about 4 MB).
    overwrite : bool
    storage_options : dict, optional

    Returns
    -------
    Dataset

    Raises
    ------
    ParameterError
        A size below 1, a negative or non-finite noise (before anything is written).
    OutputExistsError
        ``url`` exists and not ``overwrite``.

    Memory is bounded by one slab of samples, whatever ``samples`` is.

    Examples
    --------
    >>> ds = generate_mhla("data.zarr", d=2, heads=1, length=100, samples=512, overwrite=True)  # doctest: +SKIP
    """
    d, heads, length, samples = (integer(k, v, 1) for k, v in
                                 (("d", d), ("heads", heads), ("length", length), ("samples", samples)))
    d_out = integer("d_out", d_out, 1, none_ok=True)
    teacher_seed = integer("teacher_seed", teacher_seed, 0, none_ok=True)
    noise = real("noise", noise, 0.0, MAX_TARGET / 10)  # (a 10-sigma draw stays within what a fit accepts)
    chunk_samples = integer("chunk_samples", chunk_samples, 1, none_ok=True)
    o = d if d_out is None else d_out
    n = min(samples, chunk_samples or default_chunk_samples(length, d))  # one slab of samples at a time
    per_sample = length * (2 * d + 2 * o + (d * d if causal else 0)) + d * d  # tokens, targets, S = sum z z^T
    _check_memory(f"the teacher (`heads={heads}`, `d={d}`, `d_out={o}`) and one chunk ({n:,} sample{'s' * (n > 1)}"
                  f" of `length={length}`{', causal' if causal else ''})", 8.0 * (heads * d * (d + o) + n * per_sample))
    check_path(url, "generate_mhla", "as `url` the output store's path or URL")
    check_storage_options(storage_options, url)  # (fsspec's options reach URLs only)
    loc = resolve(url, storage_options)
    V, Q = make_teacher(d, heads, d_out, seed if teacher_seed is None else teacher_seed)
    attrs = {"generator": {"task": "mhla", "d": d, "heads": heads, "length": length, "samples": samples,
                           "d_out": int(V.shape[1]), "noise": noise, "causal": causal, "seed": seed,
                           **({} if teacher_seed is None else {"teacher_seed": teacher_seed})},
             "description": "realizable multi-head linear attention data [Yau et al. 2025, Sec. 4.1]"}
    with atomic_output(loc, overwrite, _formats.DATASET[0]) as tmp:
        g = create_dataset(tmp, samples, length, d, V.shape[1], causal=causal, lengths=variable_lengths,
                           chunk_samples=chunk_samples, attrs=attrs)
        chunk = g["tokens"].chunks[0]
        sums = {}
        for i, a in enumerate(range(0, samples, chunk)):
            b = min(samples, a + chunk)
            part = make_mhla(d, heads, length, b - a, noise=noise, causal=causal,
                             variable_lengths=variable_lengths, teacher=(V, Q), seed=[seed, i])
            write_block(g, a, part["tokens"], part["targets"], part["lengths"], sums)
        write_teacher(g, V, Q, sums)
        finish_dataset(g, sums)
    return open_dataset(loc)


def _check_memory(what: str, need: float) -> None:
    """Refuse sizes whose arrays cannot exist in this machine's memory (numpy's MemoryError came after the output
    was opened, as an internal error), naming the sizes and the bytes they would take."""
    have = available_memory()
    if need > have:
        raise InsufficientMemoryError(f"{what} need {need / GIB:,.1f} GiB of memory at once; this machine has"
                                      f" {have / GIB:,.1f} GiB available: use smaller sizes")


def make_assoc(pairs: int = 2, samples: int = 2**14, *, dim: int | None = None, orthogonal: bool = False, seed=0):
    """Associative-memory data ([Y25] §4.2; DESIGN §9): ``dict(tokens, targets)``.

    Token j = (k_j; v_j) for j = 1..K, last token (q; zeta) with q one of the keys, zeta ~ N(0, I);
    target = (0; sum_j <q, k_j> v_j). Keys/values are unit-norm Gaussian, or with ``orthogonal`` the rows of
    a fresh random orthogonal matrix per sample (not identifiable). Token dimension ``2 * dim``.
    """
    dim = pairs if dim is None else dim
    if orthogonal and pairs > dim:
        raise ParameterError(f"orthogonal keys need `pairs` <= `dim`, got `pairs={pairs}`, `dim={dim}`")
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
    """Write an associative-memory dataset (:func:`make_assoc`); return it opened.

    Raises :class:`~scaleattn.errors.ParameterError` for ``pairs``, ``samples`` or ``dim`` below 1, or
    orthogonal keys with ``pairs > dim``."""
    pairs, samples = integer("pairs", pairs, 1), integer("samples", samples, 1)
    dim = integer("dim", dim, 1, none_ok=True)
    chunk_samples = integer("chunk_samples", chunk_samples, 1, none_ok=True)
    k = dim or pairs  # all samples in memory: keys, values, tokens (twice), targets; a QR per sample if orthogonal
    _check_memory(f"`samples={samples}`, `pairs={pairs}`, `dim={k}`{' (orthogonal)' if orthogonal else ''}",
                  8.0 * samples * (8 * (pairs + 1) * k + (3 * k * k if orthogonal else 0)))
    data = make_assoc(pairs, samples, dim=dim, orthogonal=orthogonal, seed=seed)
    attrs = {"generator": {"task": "assoc", "pairs": pairs, "dim": dim or pairs, "samples": samples,
                           "orthogonal": orthogonal, "seed": seed},
             "description": "associative memory task [Yau et al. 2025, Sec. 4.2]"}
    return write_dataset(url, data["tokens"], data["targets"], chunk_samples=chunk_samples, attrs=attrs,
                         overwrite=overwrite, storage_options=storage_options)


def make_icl_regression(k: int = 4, context: int = 20, samples: int = 4096, seed=0):
    """In-context linear regression (Garg et al. 2022; von Oswald et al. 2023): ``dict(tokens, targets)``.

    Each sample draws ``w ~ N(0, I_k)`` and ``x_i ~ N(0, I_k)``; tokens (samples, context + 1, k + 1) float64
    are ``(x_i, w^T x_i)`` for ``i < context`` and the query ``(x_q, 0)`` last; targets (samples, 1) are
    ``w^T x_q`` (last-token data, d = k + 1, d_out = 1). ``seed``: anything ``numpy.random.default_rng`` takes.
    Raises :class:`~scaleattn.errors.ParameterError` for ``k``, ``context`` or ``samples`` below 1.
    """
    k, context, samples = integer("k", k, 1), integer("context", context, 1), integer("samples", samples, 1)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((samples, k))
    x = rng.standard_normal((samples, context + 1, k))
    y = np.einsum("ntk,nk->nt", x, w)
    tokens = np.concatenate([x, y[..., None]], -1)
    tokens[:, -1, k] = 0.0  # the query's label slot
    return dict(tokens=tokens, targets=y[:, -1:].copy())
