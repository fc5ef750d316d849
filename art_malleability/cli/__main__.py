"""``python -m art_malleability.cli``: the command line (as ``art-malleability``)."""

from art_malleability.cli import console_main

console_main()
