"""The benchmark suite: ``python -m bench`` (``make bench``) prints one table of side-by-side ratios and writes
``bench/RESULTS.md``. ``python -m bench --quick`` runs every row on small shapes (the smoke test of ``make test``).

Layout: ``core`` (results, timing, the table), ``workload`` (the shapes and SGLang answers), ``reference`` (slime's
trainer-side path), ``services`` (simulator and gateway processes), ``loadgen`` (the HTTP load generator, run in
its own process), ``rows/`` (one module per table row, listed in ``rows.ROWS``).
"""
