"""Sphinx configuration of the art-malleability documentation (``sphinx-build -W docs docs/_build/html``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("MPLBACKEND", "Agg")

from art_malleability import __version__  # noqa: E402

project = "art-malleability"
author = "the art-malleability developers"
release = version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinxarg.ext",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "furo"
html_title = f"art-malleability {__version__}"
suppress_warnings = ["myst.xref_missing"]
nitpicky = False
