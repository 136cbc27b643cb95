"""Every human-readable summary scaleattn prints, so the CLI and a notebook show the same words.

Each function takes the JSON-ready dict of a result (a fit's ``report``, ``Certificate.summary()``, the
dict of :func:`~scaleattn.evaluate`, of :func:`~scaleattn.compare_models`) and returns text; the notebook cards
that show the same facts as HTML are in :mod:`scaleattn.display._html`. Working on plain dicts keeps this module
below every other: the result objects of every layer render through it.
"""
from __future__ import annotations

import math

import numpy as np

from ..store._formats import loss_curve

__all__ = ["fit_summary", "heads_line", "validation_line", "interval_text", "lambda_min_text",
           "lambda_max_text", "lambda_resolution",
           "krylov_line", "certificate_summary", "evaluation_summary", "comparison_summary", "verdict",
           "minimal_heads", "fewer_heads_suffice", "teacher_distance_label", "METHOD_WORDS"]

#: what decided a certificate (its ``certificate_method``), in words
METHOD_WORDS = {"gram": "the float64 Gram", "qr": "a QR of the features"}
#: a settled verdict whose margin is below this multiple of its ``settle_factor`` is said to be close to the cutoff
CLOSE_FACTOR = 3.0


def verdict(r: dict) -> str:
    """The certificate's verdict in one line ([Y25] Lemma 2.3), with what decided it and the margin.

    ``r`` is ``Certificate.summary()`` or a fit report; reports written before verdicts existed (no
    ``verdict`` key) read as the old rank test. A verdict of the Gram that is not "identifiable" is qualified
    "at the precision of the float64 Gram" (a direction below its round-off may still be determined by the
    data), with a pointer to the QR certificate.
    """
    v = r.get("verdict") or ("identifiable" if r["identifiable"] else "not identifiable")
    if (r.get("estimates") or {}).get("solver") == "dual":  # fewer rows than features: no precision involved
        return (f"NOT identifiable: {r['ambiguous_dim']:,} feature direction(s) are not determined by the data"
                f" [dimension count: {r['n_rows']:,} rows, {r['psi']:,} features; rank(G) = rank(K) = {r['rank']:,}]")
    method = r.get("certificate_method", "gram")
    at = "" if method == "qr" else " at the precision of the float64 Gram"
    margin, near = r.get("margin"), r.get("settle_factor")
    if (r.get("estimates") or {}).get("solver") == "stream" and v == "identifiable" and margin is not None:
        # passes decide by Krylov iterates: a proof is never claimed, a probabilistic bound is named as such
        p = r["estimates"].get("identifiable_with_probability")
        return ("IDENTIFIABLE: every least-squares fit computes the same function [Krylov iterates over the data"
                f" passes, margin {_margin(margin)}; "
                + (f"with probability >= {p:g} by the Kuczynski-Wozniakowski bound, not a proof]" if p else
                   "an estimate: no bound from the passes clears the cutoff]"))
    # a settled verdict barely past the settle factor is flagged: another draw of the data may land either side
    close = v != "not settled" and near and margin is not None and margin < CLOSE_FACTOR * near
    how = "" if margin is None else (f" [{METHOD_WORDS.get(method, method)}, margin {_margin(margin)}"
                                     + (f", close to the cutoff: settled from {_g(near, '.3g')}x" if close else "")
                                     + "]")
    if v == "identifiable":
        return "IDENTIFIABLE: every least-squares fit computes the same function" + how
    # (the streaming paths have no statistics build for a QR to follow)
    streamed = isinstance(r.get("solver_path"), dict) and not r["solver_path"].get("statistics_written", True)
    hint = " (a QR of the features may settle it: --certificate qr)" if at and r.get("verdict") and not streamed else ""
    if v == "not identifiable":
        return (f"NOT identifiable{at}: {r['ambiguous_dim']} feature direction(s) are not determined by the data"
                + how + hint)
    if r.get("certificate_converged") is False:  # the krylov run's budget ended first: said, never guessed
        return (f"NOT SETTLED: the krylov eigenvalue estimates did not settle the rank decision (rank {r['rank']}"
                f" of {r['psi']} so far; the krylov line says why; --solver cholesky or eigh where G fits in memory)")
    return (f"NOT SETTLED{at}: rank {r['rank']} of {r['psi']}, but a value lies within"
            f" {_g(near, '.3g')}x of the cutoff, so round-off could change the rank" + how + hint)


def _round_out(x: float, digits: int, up: bool) -> str:
    """``x`` to ``digits`` significant digits, rounded away from the interval's inside (down for a lower end)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:.{digits}g}"
    e = math.floor(math.log10(abs(x))) - digits + 1
    m = x / 10.0**e
    m = math.ceil(m) if up else math.floor(m)
    return f"{m * 10.0**e:.{digits}g}"


def interval_text(value: float, interval) -> str:
    """``value`` with only the significant digits its ``interval`` holds (at most 4): the digits every point of
    ``[lower, upper]`` rounds to; ``"in [lower, upper]"`` (two digits each, rounded outwards) when not even the
    first digit is held; ``value`` to 4 digits without an interval.

    Examples
    --------
    >>> interval_text(1.23456e-5, (1.23451e-5, 1.23458e-5)), interval_text(1.23456e-5, (1.23449e-5, 1.23461e-5))
    ('1.235e-05', '1.23e-05')
    >>> interval_text(3.4e-5, (2.61e-12, 3.41e-5))
    'in [2.6e-12, 3.5e-05]'
    """
    if interval is None or value is None:
        return f"{value:.4g}"
    lo, hi = float(interval[0]), float(interval[1])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{value:.4g}" if not math.isfinite(hi) and not math.isfinite(lo) else (
            f"in [{_round_out(lo, 2, False)}, {_round_out(hi, 2, True)}]")
    for k in range(4, 0, -1):
        a, b = f"{lo:.{k}g}", f"{hi:.{k}g}"
        if a == b:
            return a
    return f"in [{_round_out(lo, 2, False)}, {_round_out(hi, 2, True)}]"


def krylov_line(r: dict) -> str:
    """How settled the krylov path's numbers are (``estimates`` of a summary or report; "" on other paths): the
    interval each extreme eigenvalue of ``Lambda_D`` is known to lie in, and the CG solve's backward error."""
    e = r.get("estimates")
    if e and e.get("solver") == "dual":
        return (f"dual: {e['kernel_rows']:,} x {e['kernel_rows']:,} kernel K = Phi Phi^T, rank {e['kernel_rank']:,}"
                " (no statistics written)" + "".join(f"\n  note: {n}" for n in e.get("notes", [])))
    if not e or e.get("solver") not in ("krylov", "stream"):
        return ""

    def iv(key):
        x = e.get(key)
        return "n/a" if x is None else (f"in [{x['lower']:.4g}, {x['upper']:.4g}]"
                                        + ("" if x["converged"] else " (wider than requested)"))

    if e["solver"] == "stream":
        kw = e.get("lambda_min_lower_probabilistic")
        line = (f"stream: {e['data_passes']} passes over the tokens ({e['preconditioner']} preconditioner, no"
                f" statistics written); lambda_min {iv('lambda_min')}, lambda_max {iv('lambda_max')}"
                + ("" if kw is None else f"; lambda_min >= {kw['lower']:.4g} with probability"
                   f" {1 - kw['failure_probability']:g} (not a proof)"))
    else:
        pre = " (K-FAC preconditioner)" if e.get("preconditioner") == "kfac" else ""  # block-Jacobi: the default
        line = (f"krylov: {e['passes']} passes over Tc{pre}; lambda_min {iv('lambda_min')}, lambda_max"
                f" {iv('lambda_max')}")
    if "backward_error" in e:
        line += (f"; CG {e['cg_iterations']} iterations, backward error {max(e['backward_error']):.2g}"
                 + ("" if e["solve_converged"] else " (target NOT reached)"))
    if "traffic" in e:
        t = e["traffic"]
        line += (f"; Tc on {t['workers']} workers ({t['tiles']} tiles), per pass {t['bytes_out_per_pass'] / 1e6:.3g} MB"
                 f" out, {t['bytes_back_per_pass'] / 1e6:.3g} MB back")
    return line + "".join(f"\n  krylov note: {n}" for n in e.get("notes", []))


def _cutoff(r: dict) -> str:
    """The rank's cutoff: on eigenvalues of the scaled Gram, or (QR) on singular values of the scaled R."""
    if r.get("certificate_method") == "qr":
        return f"(cutoff {math.sqrt(r['cutoff_rtol']):.1e} x sigma_max of R, Jacobi-scaled)"
    if (r.get("estimates") or {}).get("solver") == "dual":
        return f"(cutoff {r['cutoff_rtol']:.1e} x lambda_max of K = Phi Phi^T)"
    return f"(cutoff {r['cutoff_rtol']:.1e} x lambda_max, Jacobi-scaled)"


def _settled_by(r: dict) -> str:
    """One line when a QR of the features settled, confirmed or overruled the Gram (``certificate_method ==
    "qr"``): settled where the Gram's verdict was "not settled", confirmed where the QR's agrees with a decided
    one ("settled" there read as if the Gram had been in doubt), overruled where it differs."""
    if r.get("certificate_method") != "qr" or "gram_verdict" not in r:
        return ""
    gram = r["gram_verdict"]
    v = r.get("verdict")
    how = ("not settled by a QR of the features either" if gram == v == "not settled"  # (it read "settled")
           else ("settled" if gram == "not settled" else "confirmed" if gram == v else "overruled")
           + " by a QR of the features")
    return f"  (the Gram alone said: {gram}, rank {r['gram_rank']}, margin {_margin(r.get('gram_margin'))}; {how})"


def lambda_resolution(r: dict) -> float | None:
    """The smallest eigenvalue of ``Lambda_D`` the certificate's method can tell from 0: ``psi eps lambda_max`` for
    eigenvalues of the float64 Gram, ``(psi eps)^2 lambda_max`` for squared singular values of a QR's R (None
    without ``lambda_max``)."""
    lmax, psi = r.get("lambda_max"), r.get("psi") or 1
    if lmax is None or lmax != lmax:
        return None
    rel = psi * float(np.finfo(np.float64).eps)
    return (rel * rel if r.get("certificate_method") == "qr" else rel) * lmax


def lambda_min_text(r: dict) -> str:
    """``lambda_min`` as printed: its value, or, where the certificate found undetermined directions (rank below
    psi) and the value is below :func:`lambda_resolution`, ``0 within round-off (resolution X)``: a 1.5e-66 is
    round-off, not a measured eigenvalue; else with only the digits its ``lambda_min_interval`` holds
    (:func:`interval_text`), and "(lower end proved ...)" where a shifted factorisation proved it.

    Examples
    --------
    >>> lambda_min_text({"lambda_min": 1.5e-66, "lambda_max": 0.01, "psi": 6, "rank": 5})
    '0 within round-off (resolution 1.3e-17)'
    >>> lambda_min_text({"lambda_min": 4.795e-05, "lambda_max": 0.0071, "psi": 6, "rank": 6})
    '4.795e-05'
    >>> lambda_min_text({"lambda_min": 4.7951e-05, "lambda_max": 0.0071, "psi": 6, "rank": 6,
    ...                  "lambda_min_interval": [4.7949e-05, 4.7952e-05]})
    '4.795e-05'
    """
    lam, res = r.get("lambda_min"), lambda_resolution(r)
    if lam is None:
        return "n/a"
    if res is not None and r.get("rank", r.get("psi")) < r.get("psi", 0) and abs(lam) <= res:
        return f"0 within round-off (resolution {res:.2g})"
    iv = r.get("lambda_min_interval")
    return interval_text(lam, iv) + (" (lower end proved by a shifted Cholesky)" if r.get("certificate_proof") and iv
                                     else "")


def lambda_max_text(r: dict) -> str:
    """``lambda_max`` as printed: to 4 digits, or the digits its ``lambda_max_interval`` holds where it has one
    (:func:`interval_text`; the Cholesky path's few power steps).

    Examples
    --------
    >>> lambda_max_text({"lambda_max": 0.09046})
    '0.09046'
    >>> lambda_max_text({"lambda_max": 0.0861, "lambda_max_interval": [0.0861, 0.0922]})
    '0.09'
    >>> lambda_max_text({"lambda_max": 0.0861, "lambda_max_interval": [0.0861, 0.31]})
    'in [0.086, 0.31]'

    """
    return interval_text(r["lambda_max"], r.get("lambda_max_interval"))


def _times(x: float) -> str:
    """A ratio as ``1.0x``, ``12.3x``, ``0.031x``.

    Examples
    --------
    >>> _times(1.0), _times(12.34), _times(0.0312)
    ('1.0x', '12.3x', '0.031x')
    """
    return f"{x:.1f}x" if x >= 0.95 else f"{x:.2g}x"


def fit_summary(r: dict, command: dict | None = None) -> str:
    """A short human summary of a fit report (``FitResult.report``, report.json).

    ``command`` (what ``scaleattn fit`` measures around the fit: ``seconds`` from the command's start to its
    report, ``cluster`` seconds to start or join the cluster, ``write`` seconds to write the run and its plots)
    adds a last line with the wall time of the whole command next to the fit's own."""
    lines = [
        f"rows {r['n_rows']:,}  (samples {_samples(r)}, T {r['length']},"
        f" {'causal prefixes' if r['causal'] else 'last token'})",
        f"d {r['d']}  d_out {r['d_out']}  psi {r['psi']:,}  rank {r['rank']:,}  " + _cutoff(r),
        f"lambda_min {lambda_min_text(r)}  lambda_max {lambda_max_text(r)}  (Lambda_D = G/N)",
        f"certificate: {verdict(r)}",
        *([_settled_by(r)] if _settled_by(r) else []),
        *([krylov_line(r)] if krylov_line(r) else []),
        f"train MSE {r['train_mse']:.4g}  (relative {_g(r['relative_train_mse'], '.3g')};"
        f" mean y^2 {r['target_mean_square']:.4g})",
        *([validation_line(r)] if "validation_mse" in r else []),
        heads_line(r),
    ]
    if fewer_heads_suffice(r):  # only the teacher can tell this about svd heads (the head search finds the count)
        m = minimal_heads(r)
        heads = f"{m['count']} head" + ("s" if m["count"] > 1 else "")
        verb = ("computes" if m["count"] == 1 else "compute") if m["exact"] else "may compute"
        lines.append(f"fewer heads suffice: the teacher's {heads} {verb} the fitted function"
                     " (--heads minimal finds the fewest)")
    if len(r.get("loss_vs_heads", [])) > 1:
        what, points = loss_curve(r["loss_vs_heads"])
        # (from the statistics formula, with its own round-off floor: not the measured train MSE line above)
        lines.append(f"loss vs heads ({what}, from the statistics): " + "  ".join(f"{h}:{v:.3g}" for h, v in points))
        few = r.get("heads_fewer_within")
        if few:  # the curve flattens early: "minimal" means exact, which noisy data make the generic bound
            k = few["heads"]
            lines.append(f"fewer heads: {k} {'head comes' if k == 1 else 'heads come'} within"
                         f" {100 * few['relative_gap']:.2g} % of the"
                         f" {what} of these {r['n_heads']} (--heads {few['heads']})")
    if r.get("ridge"):
        lines.append(f"ridge {r['ridge']:.3g}  effective dof {r['effective_dof']:.4g} of {r['psi']} per output")
    if "witness" in r:
        w = r["witness"]
        rel = w.get("prediction_relative_difference")
        gap = "" if rel is None else f" ({_times(rel)} the prediction scale)"
        if w.get("conclusive", True):
            lines.append(f"witness: two fits with train MSE {w['loss_a']:.6g} and {w['loss_b']:.6g} differ by"
                         f" {w['prediction_difference']:.3g} in norm{gap} in their predictions on a"
                         f" {len(w['tokens'])}-token input (report.json: witness)")
        elif w.get("certificate_verdict", "not identifiable") != "not identifiable":
            lines.append("witness: inconclusive, not a proof of ambiguity: the certificate is"
                         f" {w['certificate_verdict']} (fits with equal train MSE differ by"
                         f" {w['prediction_difference']:.3g} in norm{gap} on a {len(w['tokens'])}-token input, but"
                         " the data may determine that direction below the precision of the method)")
        else:
            # the step was shrunk: the computed loss moves along the direction, but below the precision the
            # certificate decides at (which is why it counts the direction as undetermined): no proof either way
            prec = "the float64 features" if r.get("certificate_method") == "qr" else "the float64 Gram"
            lines.append(f"witness: inconclusive, not a proof of ambiguity: fits with equal train MSE differ by only"
                         f" {w['prediction_difference']:.3g} in norm{gap} on a {len(w['tokens'])}-token input (the"
                         " computed loss does change along that direction, but more weakly than the cutoff, the"
                         f" precision of {prec}, so the certificate counts it as undetermined; this pair does not"
                         " overturn the verdict)")
    t = r.get("timings", {})
    steps = [f"{k} {t[k]:.2f} s" for k in ("statistics", "qr", "solve", "heads", "evaluate", "validation") if k in t]
    lines.append(f"wall time {r['seconds']:.2f} s" + (f" ({', '.join(steps)})" if steps else ""))
    if command is not None:
        parts = [f"{label} {command[k]:.2f} s" for k, label in (("cluster", "cluster start"), ("write", "write"))
                 if command.get(k) is not None]
        lines.append(f"command {command['seconds']:.2f} s until this report"
                     + (f" ({', '.join(parts)})" if parts else ""))
    return "\n".join(lines)


def _samples(r: dict) -> str:
    """The samples a fit's rows come from: ``512``, or with validation ``409 of 512``."""
    fitted = r.get("train_samples")
    return f"{r['n_samples']:,}" if fitted is None else f"{fitted:,} of {r['n_samples']:,}"


def validation_line(r: dict) -> str:
    """The held-out samples' MSE of a fit with ``validation`` (``validation_mse``, docs/report.md).

    Examples
    --------
    >>> validation_line({"validation_mse": 0.0127, "relative_validation_mse": 0.94, "validation_samples": 13,
    ...                  "n_samples": 64})
    'validation MSE 0.0127  (relative 0.94; the last 13 of 64 samples, held out of the fit)'
    """
    k = r["validation_samples"]
    return (f"validation MSE {r['validation_mse']:.4g}  (relative {_g(r.get('relative_validation_mse'), '.3g')};"
            f" the last {k:,} of {r['n_samples']:,} samples, held out of the fit)")


def heads_line(r: dict) -> str:
    """``heads 4 (minimal)  minimal: yes, meets the bound 4 (dimension count (generic data))`` and kin."""
    line = f"heads {r['n_heads']} ({r['heads_method']})"
    if "heads_lower_bound" in r:
        k, kind = r["heads_lower_bound"], r["heads_lower_bound_kind"]
        if r["heads_method"] == "svd":
            line += f"  bound {k} ({kind}; --heads minimal for the fewest)"
        elif not r["heads_exact"]:
            line += (f"  lossy: no exact {r['n_heads']}-head model found (exact needs >= {k}: {kind});"
                     f" ||c_H - c||/||c|| = {r['heads_residual']:.3g},"
                     f" {'ridge objective' if r.get('ridge') else 'train MSE'} +{r['heads_loss_gap']:.3g}")
        elif r["heads_meets_bound"]:
            line += f"  minimal: yes, meets the bound {k} ({kind})"
        else:
            line += f"  fewest found; bound {k} ({kind})"
        if r["heads_budget_exhausted"]:
            line += f"  [search budget ran out after {r['heads_search_seconds']:.1f} s]"
    if "teacher_heads" in r:
        line += f"  teacher heads {r['teacher_heads']}, {teacher_distance_label(r)} = {r['teacher_coef_distance']:.3g}"
    return line


def teacher_distance_label(r: dict) -> str:
    """What ``teacher_coef_distance`` measures: the saved model's coefficients, which are the fit's (``||c -
    c_teacher||``) unless lossy heads replaced them (``||c_H - c_teacher||``, the H-head model's: the same label
    read as the fit's distance in one run and the heads' in another).

    Examples
    --------
    >>> teacher_distance_label({"heads_exact": False, "n_heads": 3}), teacher_distance_label({})
    ('||c_H - c_teacher|| (the 3-head model)', '||c - c_teacher||')
    """
    if r.get("heads_exact", True) is False:
        return f"||c_H - c_teacher|| (the {r['n_heads']}-head model)"
    return "||c - c_teacher||"


def certificate_summary(s: dict) -> str:
    """Two lines (three when a QR settled, confirmed or overruled the Gram's verdict) for ``Certificate.summary()``
    (``scaleattn certify``)."""
    return (f"rows {s['n_rows']:,}  psi {s['psi']:,}  rank {s['rank']:,}  lambda_min {lambda_min_text(s)}"
            f"  lambda_max {lambda_max_text(s)}\ncertificate: {verdict(s)}"
            + (f"\n{_settled_by(s)}" if _settled_by(s) else "") + (f"\n{krylov_line(s)}" if krylov_line(s) else ""))


def evaluation_summary(r: dict) -> str:
    """One line for :func:`scaleattn.evaluate`'s result (``scaleattn evaluate``)."""
    return (f"MSE {r['mse']:.6g}  (relative {_g(r['relative_mse'], '.3g')}, mean y^2 {r['target_mean_square']:.4g},"
            f" rows {r['n_rows']:,})")


def comparison_summary(r: dict) -> str:
    """Two lines for :func:`scaleattn.compare_models`'s result (``scaleattn compare``)."""
    v = "EQUIVALENT: same function on every input" if r["equivalent"] else "DIFFERENT functions"
    return (f"||c(A) - c(B)||_F = {r['distance']:.4g}  (relative {r['relative_distance']:.3g}, rtol {r['rtol']:.1e};"
            f" heads {r['n_heads_a']} vs {r['n_heads_b']})\n{v}")


def _margin(m) -> str:
    """A certificate's margin, ``1.65e+10x``; ``n/a`` where it is undefined (all features zero: no cutoff)."""
    return _g(m, ".3g") + ("x" if m is not None and m == m else "")


def _g(x, spec: str) -> str:
    """``format(x, spec)``, or ``n/a`` for a missing (None) value of strict JSON or an undefined (NaN) one of a
    result in memory (a margin or relative error of all-zero features or targets: it printed ``nan``)."""
    return "n/a" if x is None or x != x else format(x, spec)


# ---- heads: what the report knows about the fewest heads ----------------------------------------------------
def minimal_heads(r: dict) -> dict | None:
    """The fewest heads known to compute the fitted function, from a fit report.

    Returns ``{"count": k, "exact": bool, "source": str}`` or None when nothing is known: ``source`` is
    ``"head search"`` when the head search found exact heads (``heads_method`` ``"minimal"`` or ``best-H``
    with ``heads_exact``; proven the fewest when ``heads_meets_bound``), ``"teacher"`` for generated data with
    SVD heads (``teacher_heads``: the teacher's heads compute the fitted function when the fit recovered it,
    ``exact`` then, i.e. ``teacher_coef_distance <= 1e-8``; an upper bound of the fewest).

    Examples
    --------
    >>> minimal_heads({"n_heads": 4, "heads_method": "svd", "teacher_heads": 1, "teacher_coef_distance": 4e-15})
    {'count': 1, 'exact': True, 'source': 'teacher'}
    """
    method, n = r.get("heads_method"), r.get("n_heads")
    exact = r.get("heads_exact", r.get("heads_residual") is not None and r["heads_residual"] <= 1e-10)
    if n is not None and (method == "minimal" or str(method).startswith("best-")) and exact:
        return {"count": int(n), "exact": True, "source": "head search"}
    if r.get("teacher_heads") is not None:  # exact when the fit recovered the teacher's function
        dist = r.get("teacher_coef_distance")
        return {"count": int(r["teacher_heads"]), "exact": dist is not None and dist <= 1e-8, "source": "teacher"}
    return None


def fewer_heads_suffice(r: dict) -> bool:
    """True when the report's model has more heads than are known to suffice (:func:`minimal_heads`)."""
    m = minimal_heads(r)
    return m is not None and r.get("n_heads") is not None and m["count"] < int(r["n_heads"])
