"""The SPMD core: logical axis rules, meshes, metadata boxes, constraints, shardings and the
one validator. Modules here import only :mod:`meshplan._errors` and :mod:`meshplan._text`."""
