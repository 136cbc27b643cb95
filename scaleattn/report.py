"""Every human-readable summary scaleattn prints (layer L0), so the CLI and a notebook show the same words.

Each function takes the JSON-ready dict of a result (a fit's ``report``, ``Certificate.summary()``, the
dict of :func:`~scaleattn.evaluate`, of :func:`~scaleattn.compare_models`) and returns text. Working on plain
dicts keeps this module below every other: the result objects of every layer render through it.
"""
from __future__ import annotations

import math

__all__ = ["fit_summary", "heads_line", "certificate_summary", "evaluation_summary", "comparison_summary", "verdict"]


_METHOD = {"gram": "the float64 Gram", "qr": "a QR of the features"}


def verdict(r: dict) -> str:
    """The certificate's verdict in one line ([Y25] Lemma 2.3), with what decided it and the margin.

    ``r`` is ``Certificate.summary()`` or a fit report; reports written before verdicts existed (no
    ``verdict`` key) read as the old rank test. A verdict of the Gram that is not "identifiable" is qualified
    "at the precision of the float64 Gram" (a direction below its round-off may still be determined by the
    data), with a pointer to the QR certificate.
    """
    v = r.get("verdict") or ("identifiable" if r["identifiable"] else "not identifiable")
    method = r.get("certificate_method", "gram")
    at = "" if method == "qr" else " at the precision of the float64 Gram"
    margin = r.get("margin")
    how = "" if margin is None else f" [{_METHOD.get(method, method)}, margin {margin:.3g}x]"
    if v == "identifiable":
        return "IDENTIFIABLE: every least-squares fit computes the same function" + how
    near = r.get("settle_factor")
    hint = " (a QR of the features may settle it: --certificate qr)" if at and r.get("verdict") else ""
    if v == "not identifiable":
        return (f"NOT identifiable{at}: {r['ambiguous_dim']} feature direction(s) are not determined by the data"
                + how + hint)
    return (f"NOT SETTLED{at}: rank {r['rank']} of {r['psi']}, but a value lies within"
            f" {_g(near, '.3g')}x of the cutoff, so round-off could change the rank" + how + hint)


def _cutoff(r: dict) -> str:
    """The rank's cutoff: on eigenvalues of the scaled Gram, or (QR) on singular values of the scaled R."""
    if r.get("certificate_method") == "qr":
        return f"(cutoff {math.sqrt(r['cutoff_rtol']):.1e} x sigma_max of R, Jacobi-scaled)"
    return f"(cutoff {r['cutoff_rtol']:.1e} x lambda_max, Jacobi-scaled)"


def _settled_by(r: dict) -> str:
    """One line when a QR of the features overruled or confirmed the Gram (``certificate_method == "qr"``)."""
    if r.get("certificate_method") != "qr" or "gram_verdict" not in r:
        return ""
    return (f"  (the Gram alone said: {r['gram_verdict']}, rank {r['gram_rank']}, margin"
            f" {_g(r.get('gram_margin'), '.3g')}x; settled by a QR of the features)")


def fit_summary(r: dict) -> str:
    """A short human summary of a fit report (``FitResult.report``, report.json)."""
    lines = [
        f"rows {r['n_rows']:,}  (samples {r['n_samples']:,}, T {r['length']},"
        f" {'causal prefixes' if r['causal'] else 'last token'})",
        f"d {r['d']}  d_out {r['d_out']}  psi {r['psi']:,}  rank {r['rank']:,}  " + _cutoff(r),
        f"lambda_min {r['lambda_min']:.4g}  lambda_max {r['lambda_max']:.4g}  (Lambda_D = G/N)",
        f"certificate: {verdict(r)}",
        *([_settled_by(r)] if _settled_by(r) else []),
        f"train MSE {r['train_mse']:.4g}  (relative {_g(r['relative_train_mse'], '.3g')};"
        f" mean y^2 {r['target_mean_square']:.4g})",
        heads_line(r),
    ]
    if len(r.get("loss_vs_heads", [])) > 1:
        lines.append("loss vs heads: " + "  ".join(f"{e['heads']}:{e['train_mse_stats']:.3g}"
                                                   for e in r["loss_vs_heads"]))
    if r.get("ridge"):
        lines.append(f"ridge {r['ridge']:.3g}  effective dof {r['effective_dof']:.4g} of {r['psi']} per output")
    if "witness" in r:
        w = r["witness"]
        gap = f" ({w['prediction_relative_difference']:.3g} of the prediction scale)" if (
            w.get("prediction_relative_difference") is not None) else ""
        if w.get("conclusive", True):
            lines.append(f"witness: two fits with train MSE {w['loss_a']:.6g} and {w['loss_b']:.6g} differ by"
                         f" {w['prediction_difference']:.3g} (norm){gap} in their predictions on a"
                         f" {len(w['tokens'])}-token input (report.json: witness)")
        elif w.get("certificate_verdict", "not identifiable") != "not identifiable":
            lines.append("witness: inconclusive, not a proof of ambiguity: the certificate is"
                         f" {w['certificate_verdict']} (fits with equal train MSE differ by"
                         f" {w['prediction_difference']:.3g}{gap} on a {len(w['tokens'])}-token input, but the data"
                         " may determine that direction below the precision of the method)")
        else:
            lines.append(f"witness: inconclusive, not a proof of ambiguity: fits with equal train MSE differ by only"
                         f" {w['prediction_difference']:.3g}{gap} on a {len(w['tokens'])}-token input (round-off of"
                         " the training loss; the data do change it along that direction)")
    lines.append(f"wall time {r['seconds']:.2f} s")
    return "\n".join(lines)


def heads_line(r: dict) -> str:
    """``heads 4 (minimal)  minimal: yes, meets the bound 4 (dimension count (generic data))`` and kin."""
    line = f"heads {r['n_heads']} ({r['heads_method']})"
    if "heads_lower_bound" in r:
        k, kind = r["heads_lower_bound"], r["heads_lower_bound_kind"]
        if r["heads_method"] == "svd":
            line += f"  bound {k} ({kind}; --heads minimal for the fewest)"
        elif not r["heads_exact"]:
            line += (f"  lossy: no exact {r['n_heads']}-head model found (exact needs >= {k}: {kind});"
                     f" ||c_H - c||/||c|| = {r['heads_residual']:.3g}, train MSE +{r['heads_loss_gap']:.3g}")
        elif r["heads_meets_bound"]:
            line += f"  minimal: yes, meets the bound {k} ({kind})"
        else:
            line += f"  fewest found; bound {k} ({kind})"
        if r["heads_budget_exhausted"]:
            line += f"  [search budget ran out after {r['heads_search_seconds']:.1f} s]"
    if "teacher_heads" in r:
        line += f"  teacher heads {r['teacher_heads']}, ||c - c_teacher|| = {r['teacher_coef_distance']:.3g}"
    return line


def certificate_summary(s: dict) -> str:
    """Two lines (three when a QR settled the Gram's verdict) for ``Certificate.summary()`` (``scaleattn
    certify``)."""
    return (f"rows {s['n_rows']:,}  psi {s['psi']:,}  rank {s['rank']:,}  lambda_min {s['lambda_min']:.4g}"
            f"  lambda_max {s['lambda_max']:.4g}\ncertificate: {verdict(s)}"
            + (f"\n{_settled_by(s)}" if _settled_by(s) else ""))


def evaluation_summary(r: dict) -> str:
    """One line for :func:`scaleattn.evaluate`'s result (``scaleattn evaluate``)."""
    return (f"MSE {r['mse']:.6g}  (relative {_g(r['relative_mse'], '.3g')}, mean y^2 {r['target_mean_square']:.4g},"
            f" rows {r['n_rows']:,})")


def comparison_summary(r: dict) -> str:
    """Two lines for :func:`scaleattn.compare_models`'s result (``scaleattn compare``)."""
    v = "EQUIVALENT: same function on every input" if r["equivalent"] else "DIFFERENT functions"
    return (f"||c(A) - c(B)||_F = {r['distance']:.4g}  (relative {r['relative_distance']:.3g}, rtol {r['rtol']:.1e};"
            f" heads {r['n_heads_a']} vs {r['n_heads_b']})\n{v}")


def _g(x, spec: str) -> str:
    """``format(x, spec)``, or ``n/a`` for a missing (None) value of strict JSON."""
    return "n/a" if x is None else format(x, spec)
