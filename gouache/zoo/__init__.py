"""The model zoo: built-in pipelines (tiny seeded, trained shapes), local diffusers directories and
full-size architectures, all loaded without a network; the runner serves what they build."""
