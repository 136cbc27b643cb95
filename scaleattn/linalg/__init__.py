"""The solver: from the statistics to the coefficients and the identifiability certificate.

Implementation modules, bottom up: ``_gram`` (the matrix-free Gram operator on the compact Gram) and its compiled
product, ``_dense`` (blocked Cholesky, extreme eigenvalues by block Krylov), ``_lanczos`` (eigenvalue estimates as
intervals), ``_spectrum`` (the Jacobi-scaled spectra and factors, the relative cutoff, the min-norm step),
``_krylov`` (matrix-free CG with deflation), ``_certificate`` (the three-valued verdict), ``_qr`` (the QR
certificate of the features), and ``_solver`` (the router: one choice of path for solve and certify).
DESIGN §4.
"""
from ._certificate import Certificate, certify
from ._krylov import KrylovSolution, krylov_solve
from ._solver import Solution, solve

__all__ = ["Solution", "solve", "Certificate", "certify", "KrylovSolution", "krylov_solve"]
