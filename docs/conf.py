"""Sphinx configuration of trainguard's docs site: Markdown pages (MyST), built by `make docs`.

`make docs` runs sphinx-build with -W (every warning is an error) and -n (every
reference must resolve): a broken link or anchor, a page left out of the toctree or a
missing page fails the build.
"""

from __future__ import annotations

project = "trainguard"
author = "the trainguard authors"
copyright = "the trainguard authors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "examples", "README.md"]

# Links to a heading of another page (`security.md#what-is-checked`) resolve by the same
# slugs GitHub makes, so the pages read the same on GitHub and on the site.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = "trainguard"
html_show_sourcelink = False
html_theme_options = {"description": "Fault-tolerant distributed PyTorch training"}
