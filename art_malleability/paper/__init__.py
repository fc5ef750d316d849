"""
Research code of the paper reproduction (Miñoza, Medina & Ibañez, 2026), apart from the library.

- :mod:`art_malleability.paper.reproduce`: Tables 1–4, the ε ablation and the spectral numbers with the
  paper's protocol, five seeds, controls and the LDS of the estimator (``art-malleability reproduce``);
- :mod:`art_malleability.paper.open_choices`: the sensitivity study of the details the paper leaves open
  (``art-malleability reproduce --tables open_choices``).

It holds the paper's numbers, tables, figures and their formatting; the library (``art_malleability``) does not
import it. The command line imports it on demand.
"""
