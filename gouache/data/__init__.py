"""Procedural, checkable training data: scenes of coloured shapes (`shapes`) and an analytic
checker that says whether an image shows a scene (`checker`). No torch here."""
