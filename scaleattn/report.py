"""Every human-readable summary scaleattn prints (layer L0), so the CLI and a notebook show the same words.

Each function takes the JSON-ready dict of a result (a fit's ``report``, ``Certificate.summary()``, the
dict of :func:`~scaleattn.evaluate`, of :func:`~scaleattn.compare_models`) and returns text, or HTML for the
notebook cards (``*_html``: the ``_repr_html_`` of ``FitResult``, ``Certificate``, ``Statistics`` and
``MHLAModel``; an inline SVG spectrum with numpy alone). Working on plain dicts (and arrays) keeps this module
below every other: the result objects of every layer render through it.
"""
from __future__ import annotations

import html
import math

import numpy as np

from ._formats import loss_curve

__all__ = ["fit_summary", "heads_line", "krylov_line", "certificate_summary",
           "evaluation_summary", "comparison_summary", "verdict", "minimal_heads", "fewer_heads_suffice", "spectrum_svg", "certificate_html",
           "fit_html", "statistics_html", "model_html", "safe_html"]


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
    if r.get("certificate_converged") is False:  # the krylov run's budget ended first: said, never guessed
        return (f"NOT SETTLED: the krylov eigenvalue estimates did not settle the rank decision (rank {r['rank']}"
                f" of {r['psi']} so far; the krylov line says why; --solver cholesky or eigh where G fits in memory)")
    return (f"NOT SETTLED{at}: rank {r['rank']} of {r['psi']}, but a value lies within"
            f" {_g(near, '.3g')}x of the cutoff, so round-off could change the rank" + how + hint)


def krylov_line(r: dict) -> str:
    """How settled the krylov path's numbers are (``estimates`` of a summary or report; "" on other paths): the
    interval each extreme eigenvalue of ``Lambda_D`` is known to lie in, and the CG solve's backward error."""
    e = r.get("estimates")
    if not e or e.get("solver") != "krylov":
        return ""

    def iv(key):
        x = e.get(key)
        return "n/a" if x is None else (f"in [{x['lower']:.4g}, {x['upper']:.4g}]"
                                        + ("" if x["converged"] else " (wider than requested)"))

    line = f"krylov: {e['passes']} passes over Tc; lambda_min {iv('lambda_min')}, lambda_max {iv('lambda_max')}"
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
    return f"(cutoff {r['cutoff_rtol']:.1e} x lambda_max, Jacobi-scaled)"


def _settled_by(r: dict) -> str:
    """One line when a QR of the features settled, confirmed or overruled the Gram (``certificate_method ==
    "qr"``): settled where the Gram's verdict was "not settled", confirmed where the QR's agrees with a decided
    one ("settled" there read as if the Gram had been in doubt), overruled where it differs."""
    if r.get("certificate_method") != "qr" or "gram_verdict" not in r:
        return ""
    gram = r["gram_verdict"]
    how = "settled" if gram == "not settled" else "confirmed" if gram == r.get("verdict") else "overruled"
    return (f"  (the Gram alone said: {gram}, rank {r['gram_rank']}, margin"
            f" {_g(r.get('gram_margin'), '.3g')}x; {how} by a QR of the features)")


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
        f"rows {r['n_rows']:,}  (samples {r['n_samples']:,}, T {r['length']},"
        f" {'causal prefixes' if r['causal'] else 'last token'})",
        f"d {r['d']}  d_out {r['d_out']}  psi {r['psi']:,}  rank {r['rank']:,}  " + _cutoff(r),
        f"lambda_min {r['lambda_min']:.4g}  lambda_max {r['lambda_max']:.4g}  (Lambda_D = G/N)",
        f"certificate: {verdict(r)}",
        *([_settled_by(r)] if _settled_by(r) else []),
        *([krylov_line(r)] if krylov_line(r) else []),
        f"train MSE {r['train_mse']:.4g}  (relative {_g(r['relative_train_mse'], '.3g')};"
        f" mean y^2 {r['target_mean_square']:.4g})",
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
        lines.append(f"loss vs heads ({what}): " + "  ".join(f"{h}:{v:.3g}" for h, v in points))
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
            lines.append(f"witness: inconclusive, not a proof of ambiguity: fits with equal train MSE differ by only"
                         f" {w['prediction_difference']:.3g} in norm{gap} on a {len(w['tokens'])}-token input (round-off of"
                         " the training loss; the data do change it along that direction)")
    t = r.get("timings", {})
    steps = [f"{k} {t[k]:.2f} s" for k in ("statistics", "qr", "solve", "heads", "evaluate") if k in t]
    lines.append(f"wall time {r['seconds']:.2f} s" + (f" ({', '.join(steps)})" if steps else ""))
    if command is not None:
        parts = [f"{label} {command[k]:.2f} s" for k, label in (("cluster", "cluster start"), ("write", "write"))
                 if command.get(k) is not None]
        lines.append(f"command {command['seconds']:.2f} s until this report"
                     + (f" ({', '.join(parts)})" if parts else ""))
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
    """Two lines (three when a QR settled, confirmed or overruled the Gram's verdict) for ``Certificate.summary()`` (``scaleattn
    certify``)."""
    return (f"rows {s['n_rows']:,}  psi {s['psi']:,}  rank {s['rank']:,}  lambda_min {s['lambda_min']:.4g}"
            f"  lambda_max {s['lambda_max']:.4g}\ncertificate: {verdict(s)}"
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


def _g(x, spec: str) -> str:
    """``format(x, spec)``, or ``n/a`` for a missing (None) value of strict JSON."""
    return "n/a" if x is None else format(x, spec)


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


# ---- HTML cards (Jupyter: the _repr_html_ of FitResult, Certificate, Statistics, MHLAModel) ------------------
_GREEN, _RED, _AMBER, _GREY = "#2e7d32", "#c62828", "#b26a00", "#607d8b"
_COLOR = {"identifiable": _GREEN, "not identifiable": _RED, "not settled": _AMBER}


def _e(x) -> str:
    return html.escape(str(x))


def _f(x, spec: str = ".4g") -> str:
    """A number for a card (``n/a`` for None, ``nan`` kept)."""
    if x is None:
        return "n/a"
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return _e(x)


def _card(cls: str, color: str, title: str, body: str, attrs: str = "") -> str:
    return (f'<div class="scaleattn-card {cls}"{attrs} style="border:1px solid {color};border-left:6px solid {color};'
            'border-radius:4px;padding:0.45em 0.8em;margin:0.3em 0.4em 0.3em 0;font-family:sans-serif;'
            'font-size:0.9em;flex:1 1 20em;min-width:18em">'
            f'<div style="font-weight:bold;color:{color};margin-bottom:0.25em">{title}</div>{body}</div>')


def _table(rows) -> str:
    cells = "".join(f'<tr><th style="text-align:left;font-weight:normal;opacity:0.7;padding:0 1em 0 0;'
                    f'white-space:nowrap">{_e(k)}</th><td style="text-align:left;padding:0">{v}</td></tr>'
                    for k, v in rows)
    return f'<table style="border-collapse:collapse;margin:0">{cells}</table>'


def spectrum_svg(spectrum_scaled, cutoff_rtol: float | None = None, width: int = 240, height: int = 72,
                 max_points: int = 400) -> str:
    """A small inline SVG of the Jacobi-scaled spectrum (log scale, descending, relative to the largest): kept
    eigenvalues in blue, those at or below the cutoff (``cutoff_rtol`` x the largest, dashed) in red.

    ``spectrum_scaled`` is ``Certificate.spectrum_scaled``: eigenvalues of the scaled Gram, or the squared
    singular values of the scaled R of a QR certificate (whose cutoff on them is ``cutoff_rtol`` too). Needs
    only numpy (no matplotlib). Returns ``""`` for an empty or non-finite spectrum.

    Examples
    --------
    >>> spectrum_svg([1e-20, 1e-3, 1.0], 1e-12).startswith('<svg class="scaleattn-spectrum"')
    True
    """
    w = np.sort(np.asarray(spectrum_scaled, np.float64))[::-1]
    if w.size == 0 or not np.isfinite(w).all():
        return ""
    top = float(w[0]) if w[0] > 0 else 1.0
    floor = -18.0
    y = np.clip(np.log10(np.maximum(w / top, 10.0 ** floor)), floor, 0.0)
    cut = None if cutoff_rtol is None or not np.isfinite(cutoff_rtol) else float(cutoff_rtol)
    kept = w > (cut or 0.0) * top
    idx = np.unique(np.linspace(0, w.size - 1, min(w.size, max_points)).round().astype(int))
    if (~kept).any():  # always draw the boundary: the smallest kept and the largest dropped
        idx = np.union1d(idx, [int(kept.sum()) - 1, int(kept.sum())] if kept.any() else [0])
    pad_l, pad_r, pad_t, pad_b = 30, 6, 6, 14
    pw, ph = width - pad_l - pad_r, height - pad_t - pad_b

    def px(i):
        return pad_l + (pw * i / max(w.size - 1, 1))

    def py(v):
        return pad_t + ph * (-v / -floor)

    dots = "".join(f'<circle cx="{px(i):.1f}" cy="{py(y[i]):.1f}" r="1.6" fill="{"#4c72b0" if kept[i] else _RED}"/>'
                   for i in idx)
    line = ""
    if cut is not None and cut > 0:
        cy = py(max(np.log10(cut), floor))
        line = (f'<line x1="{pad_l}" x2="{width - pad_r}" y1="{cy:.1f}" y2="{cy:.1f}" stroke="currentColor" '
                f'stroke-dasharray="3,2" stroke-width="0.8"/><text x="{width - pad_r}" y="{cy - 2:.1f}" '
                'font-size="8" text-anchor="end" fill="currentColor">cutoff</text>')
    axes = (f'<line x1="{pad_l}" x2="{pad_l}" y1="{pad_t}" y2="{pad_t + ph}" stroke="currentColor" stroke-width="0.6"/>'
            f'<text x="{pad_l - 3}" y="{pad_t + 6}" font-size="8" text-anchor="end" fill="currentColor">1</text>'
            f'<text x="{pad_l - 3}" y="{pad_t + ph}" font-size="8" text-anchor="end" fill="currentColor">1e-18</text>'
            f'<text x="{pad_l + pw / 2:.0f}" y="{height - 2}" font-size="8" text-anchor="middle" fill="currentColor">'
            f'{w.size:,} scaled eigenvalues, descending</text>')
    return (f'<svg class="scaleattn-spectrum" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="Jacobi-scaled spectrum">{axes}{line}{dots}</svg>')


def _verdict_of(s: dict) -> str:
    """``verdict`` of a summary or report (the old rank test for reports written before verdicts existed)."""
    return s.get("verdict") or ("identifiable" if s["identifiable"] else "not identifiable")


def _margin_text(s: dict) -> str:
    """``clears the cutoff 1.7e+11x (smallest kept 1.7e+11 x the cutoff; largest dropped 0.0015 x)``: the
    certificate's ``margin`` and its two sides, in the method's own quantity."""
    cutoff = s["cutoff_rtol"] if s.get("certificate_method", "gram") == "gram" else math.sqrt(s["cutoff_rtol"])
    sides = []
    kept, dropped = s.get("smallest_kept_relative"), s.get("largest_dropped_relative")
    if kept is not None and np.isfinite(kept) and cutoff > 0:
        sides.append(f"smallest kept {kept / cutoff:.2g} x the cutoff")
    if dropped is not None and cutoff > 0:
        sides.append(f"largest dropped {dropped / cutoff:.2g} x")
    m = s.get("margin")
    head = "n/a" if m is None or not np.isfinite(m) else f"{m:.3g}x"
    return head + (f" ({'; '.join(sides)})" if sides else "")


def certificate_html(s: dict, spectrum_scaled=None, title: str = "Certificate") -> str:
    """The verdict card of a certificate summary (``Certificate.summary()`` or a fit report): the verdict (green
    identifiable, red not identifiable, amber not settled), ``lambda_min``, ``lambda_max``, the rank of psi,
    the margin (the factor by which the value nearest to the cutoff clears it, with the smallest kept and the
    largest dropped value in cutoffs), what decided (the float64 Gram or a QR of the features), the cutoff, the
    condition number and, with ``spectrum_scaled``, the spectrum thumbnail (:func:`spectrum_svg`).

    Parameters
    ----------
    s : dict
        ``Certificate.summary()`` or a fit report (docs/report.md §2: ``verdict``, ``margin``,
        ``smallest_kept_relative``, ``largest_dropped_relative``, ``certificate_method``, ``rank``, ``psi``,
        ``lambda_min``, ``lambda_max``, ``cutoff_rtol``, ``condition_number``, ``n_rows``).
    spectrum_scaled : array, optional
        ``Certificate.spectrum_scaled``, for the thumbnail.
    title : str

    Returns
    -------
    str
        ``<div class="scaleattn-card scaleattn-verdict" data-verdict="identifiable">`` (``"not-identifiable"``,
        ``"not-settled"``), so pages and tests can find it.
    """
    v = _verdict_of(s)
    color = _COLOR.get(v, _AMBER)
    head = {"identifiable": "&#10004; ", "not identifiable": "&#10008; "}.get(v, "? ") + _e(verdict(s))
    method = s.get("certificate_method", "gram")
    rows = [("lambda_min", f"{_f(s['lambda_min'])}  <span style='opacity:0.7'>(of Lambda_D = G/N)</span>"),
            ("lambda_max", _f(s["lambda_max"])),
            ("rank", f"{s['rank']:,} of psi = {s['psi']:,}"
                     + (f" ({s['ambiguous_dim']:,} ambiguous)" if s["rank"] < s["psi"] else "")),
            ("margin", _e(_margin_text(s))),
            ("decided by", _e(_METHOD.get(method, method))
             + (f" (the Gram said: {_e(s['gram_verdict'])})" if method == "qr" and "gram_verdict" in s else "")),
            ("cutoff", f"{_f(s['cutoff_rtol'], '.1e')} x the largest scaled eigenvalue"),
            ("condition", _f(s.get("condition_number"), ".3g")), ("rows", f"{s['n_rows']:,}")]
    svg = "" if spectrum_scaled is None else spectrum_svg(spectrum_scaled, s["cutoff_rtol"])
    body = (f'<div style="display:flex;flex-wrap:wrap;gap:0.8em;align-items:center">{_table(rows)}'
            f'<div style="color:inherit">{svg}</div></div>')
    return _card("scaleattn-verdict", color, f"{_e(title)}: {head}", body, f' data-verdict="{v.replace(" ", "-")}"')


def _heads_card(r: dict) -> str:
    mh = minimal_heads(r)
    rows = [("heads", f"{r['n_heads']} ({_e(r['heads_method'])})")]
    if "heads_lower_bound" in r:
        proven = " (met: the fewest)" if r.get("heads_meets_bound") else ""
        rows.append(("lower bound", f"{r['heads_lower_bound']}{proven} <span style='opacity:0.7'>"
                                    f"({_e(r.get('heads_lower_bound_kind', ''))})</span>"))
    note = ""
    if mh is not None:
        if mh["source"] == "teacher":
            rows.append(("teacher heads", str(mh["count"])))
        if fewer_heads_suffice(r):
            verb = ("computes" if mh["count"] == 1 else "compute") if mh["exact"] else "may compute"
            note = (f'<div class="scaleattn-fewer-heads" style="margin-top:0.25em">fewer heads suffice: '
                    f'{mh["count"]} {verb} the same function'
                    + ("" if mh["source"] == "head search" else " (heads='minimal' finds the fewest)") + "</div>")
    if r.get("heads_residual") is not None:
        rows.append(("residual", f"{_f(r['heads_residual'], '.2g')} <span style='opacity:0.7'>"
                                 "(||c(heads) - c|| / ||c||)</span>"))
    lvh = r.get("loss_vs_heads") or []
    if len(lvh) > 1:
        what, points = loss_curve(lvh)
        rows.append((f"loss vs heads ({what})", " &middot; ".join(f"{h}: {_f(v, '.3g')}" for h, v in points)))
    if r.get("heads_budget_exhausted"):
        note += (f'<div style="margin-top:0.25em">the head search stopped at its budget after'
                 f' {_f(r.get("heads_search_seconds"), ".1f")} s</div>')
    return _card("scaleattn-heads", _GREY, "Heads", _table(rows) + note)


def fit_html(r: dict, spectrum_scaled=None, out: str | None = None, files=None) -> str:
    """The card of a fit report (``FitResult.report``, report.json): the data, the verdict card
    (:func:`certificate_html`), the fit's errors, the heads (with the fewest heads known to suffice), the
    witness, the time of each phase and the files written into ``out``.

    Parameters
    ----------
    r : dict
        The report (docs/report.md).
    spectrum_scaled : array, optional
        ``Certificate.spectrum_scaled``, for the spectrum thumbnail.
    out : str, optional
        The run directory, as the user gave it.
    files : list of str, optional
        Names written into ``out``.

    Returns
    -------
    str
        ``<div class="scaleattn-fit">`` holding one card each for the certificate, the fit, the heads, the
        witness (when there is one) and the run.
    """
    data = (f"{r['n_rows']:,} rows ({r['n_samples']:,} samples, T {r['length']},"
            f" {'causal prefixes' if r['causal'] else 'last token'}) &middot; d {r['d']}, d_out {r['d_out']},"
            f" psi {r['psi']:,}")
    head = (f'<div style="font-family:sans-serif;margin-bottom:0.2em"><b>scaleattn fit</b> of '
            f'<code>{_e(r.get("dataset", ""))}</code><br>'
            f'<span style="opacity:0.75;font-size:0.9em">{data}</span></div>')
    fit_rows = [("train MSE", _f(r.get("train_mse"))), ("relative", _f(r.get("relative_train_mse"), ".3g")),
                ("mean y^2", _f(r.get("target_mean_square")))]
    if "teacher_coef_distance" in r:
        fit_rows.append(("||c - c_teacher||", _f(r["teacher_coef_distance"], ".3g")))
    if r.get("ridge"):
        fit_rows.append(("ridge", f"{_f(r['ridge'], '.3g')} (effective dof {_f(r.get('effective_dof'))})"))
    cards = [certificate_html(r, spectrum_scaled), _card("scaleattn-fit-errors", _GREY, "Fit", _table(fit_rows)),
             _heads_card(r)]
    if "witness" in r:
        w = r["witness"]
        proof = w.get("conclusive", True)
        cards.append(_card("scaleattn-witness", _RED if proof else _GREY,
                           "Witness: equal loss, different functions" if proof
                           else "Witness: inconclusive (not a proof of ambiguity)", _table([
                               ("train MSE", f"{_f(w['loss_a'], '.6g')} and {_f(w['loss_b'], '.6g')}"),
                               ("predictions differ by",
                                f"{_f(w['prediction_difference'], '.3g')} on a {len(w['tokens'])}-token input"),
                           ])))
    t = r.get("timings", {})
    steps = [f"{k} {_f(t[k], '.2f')} s" for k in ("statistics", "qr", "solve", "heads", "evaluate", "plots")
             if k in t]
    run_rows = [("wall time", f"{_f(r.get('seconds'), '.2f')} s (" + ", ".join(steps) + ")"),
                ("row groups", f"{r.get('groups', 'n/a')} ({r.get('groups_resumed', 0)} resumed)")]
    if out:
        names = ", ".join(_e(f) for f in (files or []))
        run_rows.append(("wrote", f"<code>{_e(out)}</code>" + (f": {names}" if names else "")))
    cards.append(_card("scaleattn-run", _GREY, "Run", _table(run_rows)))
    return (f'<div class="scaleattn-fit" style="margin:0.2em 0">{head}'
            f'<div style="display:flex;flex-wrap:wrap;align-items:stretch">{"".join(cards)}</div></div>')


def statistics_html(s: dict) -> str:
    """The card of sufficient statistics: ``n_rows``, ``d``, ``d_out``, ``psi``, ``target_mean_square`` and
    ``nbytes`` (of the compact Gram and the moments) from ``s``."""
    rows = [("rows N", f"{s['n_rows']:,}"), ("d, d_out", f"{s['d']}, {s['d_out']}"), ("psi", f"{s['psi']:,}"),
            ("mean y^2", _f(s.get("target_mean_square")) if s["d_out"] else "no targets (Gram only)"),
            ("memory", f"{s['nbytes'] / 2**20:,.2f} MiB (compact Gram"
                       f" {s['gram_shape'][0]:,} x {s['gram_shape'][1]:,})"),
            ("use", "merge with <code>+</code>; <code>scaleattn.solve(stats)</code>, "
                    "<code>scaleattn.certify(stats)</code>")]
    return _card("scaleattn-statistics", _GREY, "Statistics", _table(rows))


def model_html(m: dict) -> str:
    """The card of a model: ``d``, ``d_out``, ``psi``, ``n_heads``, ``causal``, ``coef_norm``, the
    ``head_norms`` (list of ``(||V_h||, ||Q_h||)``, the first 12 shown) and ``attrs`` (dataset, heads_method)."""
    a = m.get("attrs") or {}
    rows = [("heads", f"{m['n_heads']}" + (f" ({_e(a['heads_method'])})" if a.get("heads_method") else "")),
            ("d, d_out, psi", f"{m['d']}, {m['d_out']}, {m['psi']:,}"), ("causal", _e(m["causal"])),
            ("||coef||_F", _f(m.get("coef_norm"), ".4g"))]
    norms = m.get("head_norms") or []
    if norms:
        shown = " &middot; ".join(f"{h}: {_f(v, '.3g')}, {_f(q, '.3g')}" for h, (v, q) in enumerate(norms[:12]))
        rows.append(("||V_h||, ||Q_h||", shown + (" ..." if len(norms) > 12 else "")))
    if a.get("dataset"):
        rows.append(("fitted on", f"<code>{_e(a['dataset'])}</code>"))
    return _card("scaleattn-model", _GREY, "MHLA model: y = sum_h V_h (Z^T Z) Q_h x", _table(rows))


def safe_html(render, *fallbacks) -> str:
    """``render()``, or, if it raises, ``<pre>`` of the first of ``fallbacks()`` that works, escaped: a
    ``_repr_html_`` never raises."""
    try:
        return render()
    except Exception:  # a card must never break the notebook: show the plain text instead
        for fallback in fallbacks:
            try:
                return f"<pre>{html.escape(str(fallback()))}</pre>"
            except Exception:
                continue
        return "<pre>(no text representation)</pre>"
