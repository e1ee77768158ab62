"""Pre-flight node checks: host (NHC-style), GEMM, collectives, a short simulated training run.

``host``, ``gemm`` and ``netcheck`` measure on one node (run by ``node``, a subprocess the
agent starts); ``judge`` turns a pool's measurements into verdicts; ``coordinator`` runs
the stages from the controller.
"""
