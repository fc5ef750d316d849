"""
art-malleability: how much does a model's reliance on its training data change when that data is
perturbed adversarially? An influence-malleability audit for PyTorch classifiers, built on IBM's
Adversarial Robustness Toolbox.

Influence matrices everywhere have shape (n_query, n_train); positive = helpful (removing the
training example would raise the query's loss).
"""

from art_malleability.audit.estimator import MalleabilityEstimator, influence_flip_rate
from art_malleability.audit.report import AttackResult, MalleabilityReport

__version__ = "0.1.0"

__all__ = ["AttackResult", "MalleabilityEstimator", "MalleabilityReport", "__version__", "influence_flip_rate"]
