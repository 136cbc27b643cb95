"""The solver: from the statistics to the coefficients and the identifiability certificate.

Implementation modules, bottom up: ``_gram`` (the matrix-free Gram operator on the compact Gram) and its compiled
product, ``_dense`` (blocked Cholesky, extreme eigenvalues by block Krylov), ``_lanczos`` (eigenvalue estimates as
intervals), ``_spectrum`` (the Jacobi-scaled spectra and factors, the relative cutoff, the min-norm step),
``_certificate`` (the certificate record and its three-valued verdict, built by the paths), ``_krylov``
(matrix-free CG with deflation), ``_stream`` (the fit and certificate from passes over the tokens, and the dual for
fewer rows than features: no psi^2 object), ``_solver`` (the eigh, Cholesky and krylov paths of solve and certify
and the one router between them) and ``_qr`` (the QR certificate of the features). DESIGN §4, §4b.
"""
from ._certificate import Certificate
from ._krylov import KrylovSolution, krylov_solve
from ._solver import Solution, certify, solve
from ._stream import StreamSolution, dual_solve, rows_from_arrays, rows_from_dataset, stream_solve

__all__ = ["Solution", "solve", "Certificate", "certify", "KrylovSolution", "krylov_solve",
           "StreamSolution", "stream_solve", "dual_solve", "rows_from_arrays", "rows_from_dataset"]
