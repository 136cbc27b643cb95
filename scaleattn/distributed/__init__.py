"""Layer L3: the Dask side of scaleattn (DESIGN §6).

``reduction`` (the fixed-order tree and the one submit/wait/cancel helper), ``partition`` (row groups and column
tiles), ``checkpoint`` (partials of a build), ``memory`` (estimates and refusals) -> ``build`` (the statistics
build), ``evaluate`` (the MSE pass), ``cluster`` (connect, TLS).
"""

__all__: list[str] = []
