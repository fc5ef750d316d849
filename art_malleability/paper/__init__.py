"""
Research code of the paper reproduction (Miñoza, Medina & Ibañez, 2026), apart from the library.

- :mod:`art_malleability.paper.reproduce`: Tables 1–4, the ε ablation and the spectral numbers with the
  paper's protocol, five seeds, controls and the LDS of the estimator (``art-malleability reproduce``);
- :mod:`art_malleability.paper.open_choices`: the sensitivity study of the details the paper leaves open
  (``art-malleability reproduce --tables open_choices``);
- :mod:`art_malleability.paper.common`: the steps both share (train under the run's protocol, audit, table rows,
  pooling over seeds);
- :mod:`art_malleability.paper.tables`: formatting of the tables and figures;
- :mod:`art_malleability.paper.numbers`: the paper's reported numbers.

It holds the paper's numbers, tables, figures and their formatting; the library (``art_malleability``) does not
import it. The command line imports it on demand.
"""
