"""Benchmarks of ``jaxrl bench NAME``: each module runs jaxrl and its peer on the same work and prints a
table and JSON (docs/benchmarks.md).

Layer (docs/design.md): may import ``envs``, ``rl`` and the layers below; not ``cli``. The peers' harnesses
are scripts in the repository's ``benchmarks/`` folder.
"""
