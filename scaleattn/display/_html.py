"""The notebook cards (layer L0, beside :mod:`scaleattn.display._text`): the ``_repr_html_`` of ``FitResult``,
``Certificate``, ``Statistics`` and ``MHLAModel``, the same facts as the text summaries, as HTML, with an inline
SVG spectrum drawn with numpy alone. Each function takes the JSON-ready dict of a result, as the text ones do.
"""
from __future__ import annotations

import html
import math

import numpy as np

from ..store._formats import loss_curve
from ._text import (
    METHOD_WORDS,
    fewer_heads_suffice,
    lambda_min_text,
    minimal_heads,
    teacher_distance_label,
    verdict,
)

__all__ = ["spectrum_svg", "certificate_html", "fit_html", "statistics_html", "model_html", "safe_html"]


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
    rows = [("lambda_min", f"{_e(lambda_min_text(s))}  <span style='opacity:0.7'>(of Lambda_D = G/N)</span>"),
            ("lambda_max", _f(s["lambda_max"])),
            ("rank", f"{s['rank']:,} of psi = {s['psi']:,}"
                     + (f" ({s['ambiguous_dim']:,} ambiguous)" if s["rank"] < s["psi"] else "")),
            ("margin", _e(_margin_text(s))),
            ("decided by", _e(METHOD_WORDS.get(method, method))
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
        # what it measures beside the values, as the other rows do: a long label squeezed the values of the card's
        # narrow column to a word a line
        rows.append(("loss vs heads", " &middot; ".join(f"{h}: {_f(v, '.3g')}" for h, v in points)
                     + f" <span style='opacity:0.7'>({_e(what)}, from the statistics)</span>"))
        few = r.get("heads_fewer_within")
        if few:  # the summary's hint: the card left it out
            note += (f'<div class="scaleattn-fewer-within" style="margin-top:0.25em">fewer heads:'
                     f' {few["heads"]} {"head comes" if few["heads"] == 1 else "heads come"} within'
                     f' {100 * few["relative_gap"]:.2g} % of the {_e(what)} of these'
                     f' {r["n_heads"]} (<code>heads={few["heads"]}</code>)</div>')
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
    fitted = r.get("train_samples")
    samples = f"{r['n_samples']:,}" if fitted is None else f"{fitted:,} of {r['n_samples']:,}"
    data = (f"{r['n_rows']:,} rows ({samples} samples, T {r['length']},"
            f" {'causal prefixes' if r['causal'] else 'last token'}) &middot; d {r['d']}, d_out {r['d_out']},"
            f" psi {r['psi']:,}")
    head = (f'<div style="font-family:sans-serif;margin-bottom:0.2em"><b>scaleattn fit</b> of '
            f'<code>{_e(r.get("dataset", ""))}</code><br>'
            f'<span style="opacity:0.75;font-size:0.9em">{data}</span></div>')
    fit_rows = [("train MSE", _f(r.get("train_mse"))), ("relative", _f(r.get("relative_train_mse"), ".3g")),
                ("mean y^2", _f(r.get("target_mean_square")))]
    if "validation_mse" in r:  # the held-out samples (fit's validation): the generalisation the train MSE hides
        fit_rows[2:2] = [("validation MSE", _f(r["validation_mse"])),
                         ("relative", _f(r.get("relative_validation_mse"), ".3g")),
                         ("held out", f"the last {r['validation_samples']:,} of {r['n_samples']:,} samples")]
    if "teacher_coef_distance" in r:
        fit_rows.append((teacher_distance_label(r), _f(r["teacher_coef_distance"], ".3g")))
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
    steps = [f"{k} {_f(t[k], '.2f')} s"
             for k in ("statistics", "qr", "solve", "heads", "evaluate", "validation", "plots") if k in t]
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
