"""The models gouache serves: built-in pipelines (tiny seeded, trained shapes), local diffusers
directories and full-size architectures (`zoo.py`, the catalog and loader), loaded without a
network; the runner serves what they build."""
