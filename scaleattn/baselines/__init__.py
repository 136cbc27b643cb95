"""Gradient-descent baselines against the closed-form fit (needs the optional ``torch`` extra).

- :class:`MHLA`: multi-head linear attention with ``m`` heads and ``n`` layers in PyTorch. One layer computes
  exactly DESIGN §1 / [Y25] Def. 2.1, ``y_hat = sum_h V_h (Z^T Z) Q_h x`` (no 1/n; causal prefixes
  ``S_t = sum_{s<=t} z_s z_s^T``), so :meth:`MHLA.coef` is ``c(Theta)`` of
  :func:`scaleattn.heads._algebra.coef_from_heads`.
  Deeper models stack residual layers ``z_t <- z_t + sum_h V_h S Q_h z_t``; the last layer maps to ``d_out``.
- :class:`SoftmaxTransformer` (``"full"``): pre-LayerNorm softmax attention + MLP blocks.
- :func:`train_adamw`: AdamW with the paper's settings as defaults ([Y25] §4.1; DESIGN §9: 500 epochs, lr 1e-2
  (sweep 1e-2 / 1e-3), batch 32, cosine schedule, gradient clipping), logging train / validation MSE per epoch
  and the cumulative training wall time (evaluation passes excluded). float64 on CPU by default: AdamW reaches
  ~1e-16 only in fp64.
- :func:`fit_closed_form`: our certified least squares on the same arrays (statistics -> solve -> heads).
- :func:`figure1`, :func:`figure2b`: [Y25] Figure 1 (MSE vs epoch for m heads, realizable causal data) and
  Figure 2(b) (distance ``||c(Theta) - c(Theta*)||`` of AdamW models on identifiable vs orthogonal
  associative memories); :func:`icl_regression`: in-context linear regression, closed-form MHLA vs AdamW MHLA
  vs the one-step preconditioned GD predictor (:class:`OneStepGD`) over context length.

MSE everywhere is the mean over valid rows (samples, or prefixes in causal mode) and outputs, like
:func:`scaleattn.distributed.evaluate.evaluate`.
"""
from __future__ import annotations

from .models import MHLA, SoftmaxTransformer, make_model
from .paper import (
                    OneStepGD,
                    assoc_truth,
                    figure1,
                    figure1_table,
                    figure2b,
                    icl_regression,
                    markdown_table,
                    plot_figure1,
                    plot_figure2b,
                    plot_icl,
                    ridge_in_context,
)
from .training import (
                    PAPER,
                    TrainResult,
                    coef_mse,
                    fit_closed_form,
                    load_arrays,
                    model_mse,
                    train_adamw,
)

__all__ = ["MHLA", "SoftmaxTransformer", "make_model", "PAPER", "TrainResult", "coef_mse", "fit_closed_form",
           "load_arrays", "model_mse", "train_adamw", "OneStepGD", "assoc_truth", "figure1", "figure1_table",
           "figure2b", "icl_regression", "markdown_table", "plot_figure1", "plot_figure2b", "plot_icl",
           "ridge_in_context"]
